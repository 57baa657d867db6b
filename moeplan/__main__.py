import os

# the parent this process started under, before the package's imports take their second: a
# rank of someone else's torchrun (`moeplan run` inside it) arms its parent-death signal
# against it, and exits if that parent is already gone (`runtime.lifecycle`)
os.environ["MOEPLAN_START_PPID"] = str(os.getppid())

from .cli import main  # noqa: E402

main()
