"""How a run ends early on purpose.

`UsageError` is bad user input: the CLI prints it as a single line (no
traceback) and exits with code 2. Its message must name the problem and the fix.

`RankLost` is a run ended because a rank stopped answering: one line from
the ranks that noticed, naming the silent ones, exit code 1.

`NotDistributed` is a run that asked for sharding (FSDP, ZeRO) or several
processes and did not get them (Accelerate fell back to DDP or left each rank
alone): one line, exit code 1, before any step trains unsharded.

`Stopped` is a run stopped by Ctrl-C or SIGTERM after saving a checkpoint: one
line saying where to resume, exit code 128 + the signal number, as shells report
a process ended by that signal.
"""


class UsageError(Exception):
    exit_code = 2


class Stopped(Exception):
    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class RankLost(Exception):
    exit_code = 1


class NotDistributed(Exception):
    exit_code = 1
