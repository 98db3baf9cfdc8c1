"""Stop strings across token boundaries, stream hold-back, and n>1 fan-in in the output processor."""

from __future__ import annotations

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def _feed(processor: OutputProcessor, request_id: str, ids: list[int]) -> tuple[list[str], object, list[str]]:
    deltas, last, stopped_ids = [], None, []
    for token in ids:
        outputs, stopped = processor.process([EngineCoreOutput(request_id, [token])])
        stopped_ids += stopped
        for out in outputs:
            deltas.append(out.outputs[0].delta_text)
            last = out
        if last is not None and last.finished:
            break
    return deltas, last, stopped_ids


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer) -> None:  # noqa: ANN001
    text = "The answer is forty-two. Then more text follows here."
    ids = tokenizer.encode(text)
    stop = "two. Th"
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)  # the stop string really spans several tokens
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1, 2], SamplingParams(max_tokens=100, stop=[stop]))
    processor.add("r", None, [1, 2], [request])
    deltas, last, stopped = _feed(processor, "r", ids)
    assert stopped == ["r"]
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert last.outputs[0].text == "The answer is forty-"
    assert "".join(deltas) == "The answer is forty-"
    assert not processor.has_unfinished()


def test_include_stop_str_in_output(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("alpha beta gamma delta")
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=100, stop=["gamma"], include_stop_str_in_output=True))
    processor.add("r", None, [1], [request])
    deltas, last, _ = _feed(processor, "r", ids)
    assert last.outputs[0].text == "alpha beta gamma" == "".join(deltas)


def test_n_completions_fan_in_to_one_output(tokenizer) -> None:  # noqa: ANN001
    processor = OutputProcessor(tokenizer)
    children = [Request(f"p#{i}", [1], SamplingParams(max_tokens=3, seed=i)) for i in range(2)]
    processor.add("p", "prompt", [1], children)
    a, b = tokenizer.encode(" one two three"), tokenizer.encode(" four five six")
    outputs, _ = processor.process([EngineCoreOutput("p#0", [a[0]]), EngineCoreOutput("p#1", [b[0]])])
    assert len(outputs) == 1 and [c.index for c in outputs[0].outputs] == [0, 1]
    outputs, _ = processor.process([EngineCoreOutput("p#0", [a[1]], finish_reason="length")])
    assert not outputs[0].finished and outputs[0].outputs[0].finish_reason == "length"
    assert outputs[0].outputs[1].delta_text == ""
    outputs, _ = processor.process([EngineCoreOutput("p#1", [b[1]], finish_reason="length")])
    assert outputs[0].finished
    assert [c.text for c in outputs[0].outputs] == [tokenizer.decode(a[:2]), tokenizer.decode(b[:2])]
