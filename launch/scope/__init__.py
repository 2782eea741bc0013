"""megajax-scope: MegaScope's explorer, a local page over a trained run (docs/scope.md).

  serve(workdir, port=8470)   open the run and serve its page on http://127.0.0.1:port/
  build_app(Explorer(workdir))   the Starlette app (tests, or your own ASGI server)
"""

from megajax.launch.scope.explorer import Explorer, RunMissing
from megajax.launch.scope.server import build_app, serve

__all__ = ["Explorer", "RunMissing", "build_app", "serve"]
