import contextlib, os, signal
_on = [True]
def _flip(*_):
    import specdial.engine.courier as C
    import specdial.engine.loop as L
    _on[0] = not _on[0]
    L.burst = C.burst if _on[0] else contextlib.nullcontext
if os.environ.get("BURST_TOGGLE"):
    signal.signal(signal.SIGUSR1, _flip)
