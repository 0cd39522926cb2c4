import cProfile, signal, sys, os
from specdial.cli import main
import time
prof = cProfile.Profile(time.thread_time)
OUT = os.environ["PROF_OUT"]
signal.signal(signal.SIGUSR1, lambda *a: prof.enable())
def stop(*a):
    prof.disable(); prof.dump_stats(OUT)
signal.signal(signal.SIGUSR2, stop)
sys.exit(main(sys.argv[1:]))
