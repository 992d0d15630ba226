"""Request preprocessing on the caller's thread: images, forced tool-call grammars."""
