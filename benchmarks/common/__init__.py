"""What every benchmark group shares: the machine description, the memory probes, timing, preset resolution, the
quantized weights' direct op calls, the small LLM loader, the llama.cpp peer and the JSON-lines records."""
