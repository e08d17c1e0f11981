"""The DAAF demonstration programs: what ``hpczeco prefill`` and ``hpczeco bench daaf`` run around the library's
planner, attention and controller (:mod:`hpczeco.daaf`).

- :mod:`.tokenizer`: offline tokenizers of raw text (hashed word pieces, or UTF-8 bytes): ``tokenize``;
- :mod:`.texts`: offline sample texts (standard-library source mixed with log lines): ``mixed_tokens``;
- :mod:`.model`: a random-weight decoder whose prefill uses dense attention or DAAF, on one rank or split over
  ranks by sequence or heads: ``PrefillModel``, ``ModelConfig``;
- :mod:`.control`: the weight controller driven over rounds: ``run_trace``, ``run_rounds``;
- :mod:`.serving`: a discrete-event simulation of the scheduler's policies: ``simulate``.
"""

from .control import run_rounds, run_trace
from .model import ModelConfig, PrefillEstimate, PrefillModel, PrefillResult
from .serving import simulate
from .texts import mixed_tokens
from .tokenizer import TokenLimitError, tokenize

__all__ = ["ModelConfig", "PrefillEstimate", "PrefillModel", "PrefillResult", "TokenLimitError", "mixed_tokens",
           "run_rounds", "run_trace", "simulate", "tokenize"]
