"""`shardwise plan`: predicted per-rank memory and step time of every way to train a config on a
given world of devices, ranked, with one recommended.

- model.py: the model a config names (the GPT, a transformers Llama, Qwen2 or GPT-2) on the meta
  device (parameters per unit and per pipeline end) and its saved-for-backward bytes, traced on
  fake tensors
- memory_model.py: bytes per rank by category, as our strategies hold them; the textbook ZeRO accounting
- timing.py: step time from FLOPs, collective volumes and bandwidths, and each strategy's overlap
- devices.py: device profiles (presets with sources, or measured JSON)
- candidates.py, search.py: what can run; what could win, costed (the rest pruned), ranked,
  recommended; largest micro-batches
- table.py: the table and the JSON

Predicting trains nothing, so nothing here imports the trainer; `--measure` (the top candidates
trained for a few steps on this machine's ranks, beside their predictions) is shardwise/measure.py.
"""

from shardwise.planner.devices import PRESETS, DeviceProfile, load_profile
from shardwise.planner.model import PlanError
from shardwise.planner.search import Plan, make_plan
from shardwise.planner.table import format_plan, plan_json

__all__ = ["PRESETS", "DeviceProfile", "Plan", "PlanError", "format_plan", "load_profile", "make_plan", "plan_json"]
