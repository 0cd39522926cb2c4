"""CPU per engine iteration of handing 8 streams' chunks from an engine thread to an asyncio
loop: one ``call_soon_threadsafe`` per stream (before) against the Courier (one per burst).
Process CPU (both threads) over ITER iterations, 5 alternating rounds, medians.
``PYTHONPATH=python .venv/bin/python benches/results/dp_stream/courier_cost.py``"""
import asyncio, statistics, threading, time
from specdial.engine.courier import Box, burst, courier_for

STREAMS, ITER = 8, 3000


async def per_request() -> None:
    loop = asyncio.get_running_loop()
    qs = [asyncio.Queue() for _ in range(STREAMS)]
    async def consume(q):
        for _ in range(ITER):
            await q.get()
    tasks = [asyncio.create_task(consume(q)) for q in qs]
    def engine():
        for _ in range(ITER):
            for q in qs:
                loop.call_soon_threadsafe(q.put_nowait, ["chunk"])
            time.sleep(0.0002)  # the next iteration's forward
    t = threading.Thread(target=engine); t.start()
    await asyncio.gather(*tasks); t.join()


async def courier() -> None:
    c = courier_for(asyncio.get_running_loop())
    boxes = [Box() for _ in range(STREAMS)]
    async def consume(b):
        n = 0
        while n < ITER:
            n += len(await c.take(b))
    tasks = [asyncio.create_task(consume(b)) for b in boxes]
    def engine():
        for _ in range(ITER):
            with burst():  # as the engine loop's _flush
                for b in boxes:
                    c.deliver(b, ["chunk"])
            time.sleep(0.0002)
    t = threading.Thread(target=engine); t.start()
    await asyncio.gather(*tasks); t.join()


res = {"per_request": [], "courier": []}
for r in range(5):
    for name in (("per_request", "courier") if r % 2 == 0 else ("courier", "per_request")):
        t0 = time.process_time()
        asyncio.run(per_request() if name == "per_request" else courier())
        res[name].append(1e6 * (time.process_time() - t0) / ITER)
for name, v in res.items():
    print(f"{name}: CPU us per iteration (8 streams) median {statistics.median(v):.1f}  "
          f"{[round(x, 1) for x in v]}")
