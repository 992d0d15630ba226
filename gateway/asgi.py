"""ASGI entry point for gunicorn/uvicorn: `gunicorn -c docker/gunicorn.conf.py gateway.asgi:app`."""

import logging

from gateway.app import create_asgi

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
app = create_asgi()
