"""specdial serve whose non-streaming `whole` delivery is toggled by SIGUSR1 (A/B in one process)."""
import signal, sys
from specdial.server import state as st
FLAG = {"whole": True}
orig = st.ServerState.new_run
def new_run(self, jobs, arrival, rid, whole=False):
    return orig(self, jobs, arrival, rid, whole and FLAG["whole"])
st.ServerState.new_run = new_run
def toggle(*_):
    FLAG["whole"] = not FLAG["whole"]
signal.signal(signal.SIGUSR1, toggle)
from specdial.cli import main
sys.argv = ["specdial"] + sys.argv[1:]
sys.exit(main())
