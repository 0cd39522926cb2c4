"""Server CPU per SSE write: uvicorn + Starlette StreamingResponse, 16 concurrent streams of
EVENTS events each; 'sep' = one write per event (sleep 0 between, as per-iteration delivery),
'joined4' = four events per write. Server CPU from /proc of the server process."""
import asyncio, os, subprocess, sys, time, json
if len(sys.argv) > 1 and sys.argv[1] == "serve":
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route
    async def ev(request):
        per = int(request.query_params["per"]); n = int(request.query_params["n"])
        body = "data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": None}]}) + "\n\n"
        async def gen():
            for i in range(0, n, per):
                yield body * per
                await asyncio.sleep(0.002)
        return StreamingResponse(gen(), media_type="text/event-stream")
    app = Starlette(routes=[Route("/ev", ev)])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    sys.exit()
import httpx
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
import dp_processes as d
port = d._free_port()
proc = subprocess.Popen([sys.executable, __file__, "serve", str(port)])
time.sleep(3)
async def one(c, per, n):
    async with c.stream("GET", f"http://127.0.0.1:{port}/ev?per={per}&n={n}") as r:
        async for _ in r.aiter_raw(): pass
async def main(per, n):
    async with httpx.AsyncClient(timeout=60) as c:
        await asyncio.gather(*(one(c, per, n) for _ in range(16)))
res = {1: [], 4: []}
for rep in range(6):
    for per in (1, 4) if rep % 2 == 0 else (4, 1):
        cpu = d.own_cpu_seconds(proc.pid); asyncio.run(main(per, 192))
        res[per].append(1e6 * (d.own_cpu_seconds(proc.pid) - cpu) / (16 * 192))
import statistics
for per, v in res.items():
    print(f"{per} events per write: server CPU us per event median {statistics.median(v):.1f}  {[round(x) for x in v]}")
proc.terminate()
