"""The explorer's HTTP side: a Starlette app over an Explorer, served by uvicorn on 127.0.0.1.

Routes (the page's contract; docs/scope.md): GET / (the page), /static/* (its script, style
and Plotly's own plotly.min.js from the plotly package), GET /api/info, POST /api/generate
(newline-delimited JSON, one event per decoded token, streamed), POST /api/inspect,
POST /api/compare, POST /api/logits, GET /api/activations. A refused request is a 4xx with
{"error": one line}; an unexpected failure a 500 with its one line (the traceback goes to the
server's log, never to the page)."""

from __future__ import annotations

import json
import os
import socket

from absl import logging
import plotly
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
import uvicorn

from megajax.launch.scope.explorer import Explorer, RunMissing
from megajax.observe.scope import ScopeError

STATIC = os.path.join(os.path.dirname(__file__), "static")
PLOTLY_JS = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
HOST = "127.0.0.1"


def _error(status: int, message: str) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status)


def _answer(handler):
  """An endpoint from `handler(explorer, request body or None) -> JSON-able`, its refusals 4xx."""
  async def endpoint(request: Request):
    explorer = request.app.state.explorer
    body = None
    if request.method == "POST":
      try:
        body = json.loads(await request.body() or b"{}")
      except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return _error(400, f"body: not JSON ({error}); send a JSON object")
      if not isinstance(body, dict):
        return _error(400, "body: not a JSON object; send {\"field\": value, ...}")
    try:
      return await _in_thread(handler, explorer, body)
    except ScopeError as error:
      return _error(400, str(error))
    except RunMissing as error:
      return _error(404, str(error))
    except Exception as error:     # the page gets a line; the log the traceback
      logging.exception("megajax-scope: %s %s", request.method, request.url.path)
      return _error(500, f"{type(error).__name__}: {error}")
  return endpoint


async def _in_thread(handler, explorer, body):
  result = await run_in_threadpool(handler, explorer, body)      # the model runs off the event loop
  return result if isinstance(result, (JSONResponse, StreamingResponse)) else JSONResponse(result)


def _generate(explorer: Explorer, body: dict) -> StreamingResponse:
  events = explorer.generate(body)               # refused here, before the stream starts

  def lines():
    try:
      for event in events:
        yield json.dumps(event) + "\n"
    except Exception as error:                   # mid-stream: the status is sent; say it in the stream
      logging.exception("megajax-scope: decoding failed")
      yield json.dumps({"type": "error", "error": f"{type(error).__name__}: {error}"}) + "\n"

  return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _page(request: Request):
  return FileResponse(os.path.join(STATIC, "index.html"))


async def _plotly(request: Request):
  return FileResponse(PLOTLY_JS, media_type="text/javascript")


def build_app(explorer: Explorer) -> Starlette:
  app = Starlette(routes=[
      Route("/", _page),
      Route("/static/plotly.min.js", _plotly),
      Mount("/static", StaticFiles(directory=STATIC), name="static"),
      Route("/api/info", _answer(lambda e, _: e.info())),
      Route("/api/generate", _answer(_generate), methods=["POST"]),
      Route("/api/inspect", _answer(lambda e, body: e.inspect(body)), methods=["POST"]),
      Route("/api/compare", _answer(lambda e, body: e.compare(body)), methods=["POST"]),
      Route("/api/logits", _answer(lambda e, body: e.logits(body)), methods=["POST"]),
      Route("/api/activations", _answer(lambda e, _: e.activations())),
  ])
  app.state.explorer = explorer
  return app


def listening_socket(port: int = 0, host: str = HOST) -> socket.socket:
  """A bound socket on host:port (0: any free port), for uvicorn to serve on."""
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  return sock


def server(workdir: str, sock: socket.socket) -> uvicorn.Server:
  """A uvicorn server of the explorer of `workdir` on `sock` (run it with .run(sockets=[sock]))."""
  config = uvicorn.Config(build_app(Explorer(workdir)), log_level="warning", access_log=False)
  return uvicorn.Server(config)


def serve(workdir: str, port: int = 8470, host: str = HOST, announce=print) -> None:
  """Opens the run at `workdir` and serves its explorer on http://host:port/ until interrupted."""
  sock = listening_socket(port, host)
  announce(f"megajax-scope: serving {os.path.abspath(workdir)} on http://{host}:{sock.getsockname()[1]}/ "
           f"({'this machine only' if host == HOST else 'reachable from other machines'})")
  server(workdir, sock).run(sockets=[sock])
