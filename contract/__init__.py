"""What both sides of the Triton contract share (torch-free, stdlib only): the error table."""
