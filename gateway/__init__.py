"""HTTP gateway: OpenAI chat completions and SIE-native generate in front of Triton (no torch here)."""
