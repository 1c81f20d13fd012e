"""The viewer's web app: one page (static/) and the JSON it reads, for one or more runs.

Routes: `/` the page; `/static/*` its script and style; `/api/runs` the runs given;
`/api/runs/{run}/overview` config, metrics and step list; `/api/runs/{run}/steps/{step}`
a step's trajectories; `/api/runs/{run}/search?q=&flags=` rows across steps; `/health`.
Every route only reads. A file that cannot be read answers 422 with `{"error": ...}`
naming it, which the page shows as a banner.

Bound to loopback, it answers only requests addressed to a loopback name, so a web page
elsewhere cannot reach it through a DNS name re-pointed at 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from looprl.runs.trajectories import TrajectoryFileError
from looprl.viewer.run_reader import RunReader

STATIC = Path(__file__).parent / "static"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def create_app(run_dirs: list[Path], *, loopback_host: str | None = "127.0.0.1") -> FastAPI:
    """The app for `run_dirs` (run 0 is the first). Bound to `loopback_host`, it refuses
    requests whose Host header is not a loopback name; None (another address) takes any."""
    readers = [RunReader(path) for path in run_dirs]
    app = FastAPI(title="looprl viewer", docs_url=None, redoc_url=None, openapi_url=None)
    if loopback_host is not None:
        bound = f"[{loopback_host}]" if ":" in loopback_host else loopback_host
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=[*LOOPBACK_NAMES, bound])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def reader(run: int) -> RunReader:
        if not 0 <= run < len(readers):
            raise LookupError(f"no run {run}: this viewer shows runs 0..{len(readers) - 1}")
        return readers[run]

    @app.exception_handler(LookupError)
    async def not_found(request, error: LookupError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=404)

    @app.exception_handler(FileNotFoundError)
    async def no_file(request, error: FileNotFoundError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=404)

    @app.exception_handler(TrajectoryFileError)
    async def unreadable(request, error: TrajectoryFileError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=422)

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    def health() -> dict:
        return {"runs": [r.name for r in readers]}

    @app.get("/api/runs")
    def runs() -> list[dict]:
        return [{"id": i, "name": r.name, "path": str(r.run_dir)} for i, r in enumerate(readers)]

    # Plain `def` routes: file reads run in the server's thread pool, not its event loop.
    @app.get("/api/runs/{run}/overview")
    def overview(run: int) -> Response:
        return _json(reader(run).overview())

    @app.get("/api/runs/{run}/steps/{step}")
    def step(run: int, step: int) -> Response:
        return _json(reader(run).step(step))

    @app.get("/api/runs/{run}/search")
    def search(run: int, q: str = "", flags: str = "") -> Response:
        wanted = {f for f in flags.split(",") if f}
        try:
            return _json(reader(run).search(q, wanted))
        except ValueError as e:  # an unknown flag
            return JSONResponse({"error": str(e)}, status_code=400)

    return app


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-cache"})
