"""The one exception type for bad user input.

Anything raised as `UsageError` is printed by the CLI as a single line (no
traceback) and the process exits with code 2. Its message must name the
problem and the fix.
"""


class UsageError(Exception):
    exit_code = 2
