import os
import sys

# A relaunched rank (finetune resume) on Python 3.10, which ignores
# PYTHONSAFEPATH: the current dir that `python -m` put first leaves the path
# before anything more is imported.
if os.environ.get("PYTHONSAFEPATH") and sys.version_info < (3, 11) and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from finetune.cli import entry  # noqa: E402

entry()
