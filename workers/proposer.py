"""The names vLLM's engine arguments give DAS (`speculative_config.model`, `worker_extension_cls`): stable for
users' configs, whatever the layout behind them. The code is in `workers.generator.proposer`."""

from workers.generator.proposer import DasProposer, DasWorkerExtension

__all__ = ["DasProposer", "DasWorkerExtension"]
