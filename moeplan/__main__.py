import os

# the parent this process started under, before the package's imports take their second: a
# rank of someone else's torchrun (`moeplan run` inside it) arms its parent-death signal
# against it, and exits if that parent is already gone (`runtime.lifecycle`). The pid beside
# it says whose record it is: a child inherits both, and `cli.main` records afresh for a
# process that did not write them itself (the `moeplan` console script starts there)
os.environ["MOEPLAN_START_PPID"] = str(os.getppid())
os.environ["MOEPLAN_START_PID"] = str(os.getpid())

from .cli import main  # noqa: E402

main()
