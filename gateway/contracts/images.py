"""Inline image decoding for both contracts (bounded, base64 only, never fetched)."""

from __future__ import annotations

import base64
import binascii
import re

from gateway.domain import ImageInput

MAX_IMAGES = 16
MAX_IMAGE_BYTES = 16 * 1024 * 1024
# Longest base64 text that can decode to MAX_IMAGE_BYTES; longer input is rejected unread.
_MAX_B64_CHARS = 4 * ((MAX_IMAGE_BYTES + 2) // 3)
_FORMAT = re.compile(r"[A-Za-z0-9.+-]{1,32}")


class ImageRejected(ValueError):
    """An image payload that breaks a rule; `rule` completes "'<param>' ..."."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


def decode_canonical_base64(data: str) -> bytes:
    """Decode native `images[i].data`: canonical standard base64, 1 B..16 MiB decoded."""
    if len(data) > _MAX_B64_CHARS:
        raise ImageRejected(f"must decode to at most {MAX_IMAGE_BYTES} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRejected("must be standard base64") from None
    # Re-encoding catches non-canonical padding bits, which decoders treat inconsistently.
    if base64.b64encode(raw).decode("ascii") != data:
        raise ImageRejected("must be canonical standard base64")
    _check_size(raw)
    return raw


def normalize_format(fmt: str) -> str:
    """Native `images[i].format`: 1..32 chars of [A-Za-z0-9.+-], lower-cased."""
    if not _FORMAT.fullmatch(fmt):
        raise ImageRejected("must be 1 to 32 characters of [A-Za-z0-9.+-]")
    return fmt.lower()


def decode_data_uri(uri: str) -> ImageInput:
    """Decode a chat image part `data:image/<subtype>;base64,<payload>` (remote URLs refused)."""
    if not uri[:5].lower() == "data:":
        raise ImageRejected("must be a base64 'data:' URI; remote image URLs are not supported")
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise ImageRejected("is not a well-formed data: URI")
    mime, *params = (p.strip().lower() for p in header.split(";"))
    if "base64" not in params:
        raise ImageRejected("must be a base64-encoded data: URI")
    if not mime.startswith("image/") or not _FORMAT.fullmatch(mime[6:]):
        raise ImageRejected("must carry an image/<subtype> MIME type")
    if len(payload) > _MAX_B64_CHARS:
        raise ImageRejected(f"must decode to at most {MAX_IMAGE_BYTES} bytes")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRejected("must carry valid base64 data") from None
    _check_size(raw)
    return ImageInput(data=raw, format=mime[6:])


def _check_size(raw: bytes) -> None:
    if not raw:
        raise ImageRejected("must not be empty")
    if len(raw) > MAX_IMAGE_BYTES:
        raise ImageRejected(f"must decode to at most {MAX_IMAGE_BYTES} bytes")


_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)


def sniff_format(raw: bytes) -> str:
    """Best-effort format for a native image sent without `format` ("" when unknown)."""
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "webp"
    for magic, fmt in _MAGIC:
        if raw.startswith(magic):
            return fmt
    return ""
