"""A caller for the orphan tests: starts ranks that sleep (or ignore SIGTERM), prints READY, waits to be killed."""
import signal
import sys

from helpers.runtime.launch import run
from helpers.runtime.rig import cpu_rig
from tests import workers

if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt, as in a notebook, even when started in the background (SIGINT ignored there)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("READY", flush=True)
    if sys.argv[1] == "stubborn":
        run(workers.ignore_sigterm_and_hang, rig=cpu_rig(threads=1), timeout=600)
    else:
        run(workers.pid_then_sleep, 600, rig=cpu_rig(threads=1), timeout=600)
