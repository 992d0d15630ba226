"""ASGI entry point for gunicorn/uvicorn: `gunicorn -c docker/gunicorn.conf.py gateway.asgi:app`."""

from gateway.app import create_asgi
from gateway.logs import configure_logging
from gateway.settings import Settings

settings = Settings.from_env()
configure_logging(settings.log_level)
app = create_asgi(settings)
