"""Serving engines' DeepEP call sequences (vLLM, SGLang) as data, and their replay against triton-ep on CPU."""
