"""The generator side of DAS inside vLLM: the proposer, its native decode step, the step's book, the model folders and the CPU sampling repair."""
