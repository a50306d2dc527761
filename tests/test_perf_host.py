"""The host CPU on the simulated clock (perf/host.py, CostModel.step_time): in series with the device under
synchronous scheduling, overlapped under asynchronous; never slower async, equal without CPU time."""
import dataclasses

import pytest

from minibatch import LLM, SamplingParams
from minibatch.perf.cost import CostModel
from minibatch.perf.host import HOST_CPU, HostCpuProfile
from minibatch.trace import TraceRecorder

from test_perf_cost import HW, TOY, trace


def _at(t, step, asynchronous):
    return dataclasses.replace(t, step=step, async_scheduling=asynchronous)


@pytest.mark.parametrize("per_step", [0.0, 1e-4, 1.0, 1e3])        # CPU time from none to far above the device's
@pytest.mark.parametrize("rows", [[(1, 2)], [(1, 40)] * 16, [(24, 0), (1, 7)]])
def test_async_is_never_slower_and_overlaps_exactly(per_step, rows):
    host = HostCpuProfile("h", per_step=per_step, per_seq=per_step / 10, factor=0.5)
    cm, t = CostModel(HW, TOY, host=host), trace(rows)
    device, cpu = cm.device_time(t), cm.cpu_time(t)
    assert cpu == pytest.approx(0.5 * (per_step + per_step / 10 * len(rows)))
    sync, asyn = cm.step_time(_at(t, 3, False)), cm.step_time(_at(t, 3, True))
    assert sync == pytest.approx(cpu + device) and asyn == pytest.approx(max(cpu, device))
    assert asyn <= sync
    assert cm.step_time(_at(t, 0, True)) == pytest.approx(sync)    # the first step: nothing hid its schedule
    if per_step == 0.0:
        assert asyn == sync == device


def test_without_a_host_nothing_changes():
    t = trace([(1, 5)] * 4)
    plain, host = CostModel(HW, TOY), CostModel(HW, TOY, host=HostCpuProfile("zero", 0.0, 0.0, 1.0))
    assert plain.step_time(_at(t, 2, True)) == plain.step_time(_at(t, 2, False)) == plain.device_time(t)
    assert host.step_time(_at(t, 2, True)) == host.step_time(_at(t, 2, False)) == plain.device_time(t)


def test_the_spec_names_the_host_and_bad_input_is_refused():
    cm = CostModel.from_spec("h100+cpu:target")
    assert cm.host is HOST_CPU and cm.hw.name == "h100" and "h100+cpu:target" in repr(cm)
    assert CostModel.from_spec("h100:target").host is None
    assert HOST_CPU.sources["per_step, per_seq"] and "estimate" in HOST_CPU.sources["factor"]
    with pytest.raises(ValueError, match="h100\\+gpu"):
        CostModel.from_spec("h100+gpu:target")
    with pytest.raises(ValueError, match="factor"):
        HostCpuProfile("bad", 1e-4, 1e-5, -1.0)


def test_the_engine_prices_async_steps_overlapped(target_model):
    """Through the engine: the trace says how the step was scheduled; the same tokens, less simulated time."""
    runs = {}
    for mode in (False, True):
        llm = LLM(target_model, async_scheduling=mode, simulate="h100+cpu:gpt2", max_num_seqs=4, block_size=8)
        rec = TraceRecorder()
        llm.llm_engine.add_hook(rec)
        outs = llm.generate(["def f(x):\n", "import os\n", "class A:\n", "x = ["],
                            SamplingParams(temperature=0, max_tokens=8))
        assert all(t.async_scheduling is mode for t in rec.traces)
        runs[mode] = ([o.outputs[0].token_ids for o in outs], sum(t.simulated_duration for t in rec.traces))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1]
