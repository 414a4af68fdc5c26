"""Engine-agnostic pieces the vLLM and SGLang plugins share (no engine imports here)."""
