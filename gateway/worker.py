"""The gunicorn worker class: uvicorn with the C HTTP parser (httptools) and uvloop.

uvicorn's defaults pick them only when installed; naming them here makes a missing dependency
fail at start instead of silently falling back to the pure-Python parser (several times slower).
"""

from uvicorn_worker import UvicornWorker


class GatewayWorker(UvicornWorker):
    CONFIG_KWARGS = {**UvicornWorker.CONFIG_KWARGS, "http": "httptools", "loop": "uvloop"}
