"""The Triton Python backend glue: the only code that knows triton_python_backend_utils."""
