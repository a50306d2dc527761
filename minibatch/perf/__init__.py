"""The GPU regime on a laptop: hardware and model profiles, a roofline cost model of one engine step, and
this machine's profile, measured. ``EngineConfig(simulate="h100:llama-3-8b")`` stamps each step's simulated
duration on its trace; ``minibatch.stats`` reads either clock."""
from minibatch.perf.clocks import compare_clocks, retime
from minibatch.perf.cost import CostModel, parse_simulate
from minibatch.perf.hardware import PROFILES as HARDWARE, HardwareProfile, get_hardware, load_profile
from minibatch.perf.models import ModelProfile, get_model, model_names

__all__ = ["compare_clocks", "retime", "CostModel", "parse_simulate", "HARDWARE", "HardwareProfile", "get_hardware", "load_profile",
           "ModelProfile", "get_model", "model_names"]
