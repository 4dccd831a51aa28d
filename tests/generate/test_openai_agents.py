"""The OpenAI Agents SDK, unchanged, against a real server's /v1/responses (its default API):
an agent with a function tool and a structured ``output_type`` runs a turn, not streamed and
streamed (the SDK reads the Responses events and the final ``response.completed``), and with
``tool_choice: "required"`` the tool is called and its output goes back in the next turn.

The model is tests/support/tiny_decoder.py's: it never ends a plain answer itself (the SDK
treats ``response.incomplete`` as a failure, as it does OpenAI's), so the agent's answer is a
JSON ``output_type``, which the schema's grammar completes.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
agents = pytest.importorskip("agents", reason="pip install openai-agents (the test extra)")

from openai_serving import serving  # noqa: E402
from pydantic import BaseModel  # noqa: E402

MODEL = "tiny"


class Verdict(BaseModel):
    ok: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_decoder import write

    folder = write(tmp_path_factory.mktemp("agents") / "tiny", context=2048, long_token=8)
    with serving({MODEL: (folder, "NUMPY")}) as running:
        yield running


def _agent(server, calls: list[str], **settings):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    @function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:  # an enum: a forced call ends in time
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    http = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    return Agent(
        name="forecaster",
        instructions="Answer whether the weather is fine.",
        tools=[weather],
        output_type=Verdict,
        model=OpenAIResponsesModel(model=MODEL, openai_client=http),
        model_settings=ModelSettings(**{"max_tokens": 32, "temperature": 0, **settings}),
    )


@pytest.fixture(autouse=True)
def _no_tracing():
    agents.set_tracing_disabled(True)


def test_an_agent_with_a_function_tool_runs_a_turn(server):
    calls: list[str] = []
    result = agents.Runner.run_sync(_agent(server, calls), "Is it fine in Paris?")
    assert isinstance(result.final_output, Verdict)
    assert len(result.raw_responses) == 1 and calls == []


def test_a_streamed_run_reads_the_events(server):
    async def run():
        result = agents.Runner.run_streamed(_agent(server, []), "Is it fine in Paris?")
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert isinstance(result.final_output, Verdict)
    assert "raw_response_event" in kinds


def test_a_required_tool_is_called_and_its_output_goes_back(server):
    calls: list[str] = []
    # the forced call's JSON ({"name": ..., "arguments": {...}} as bytes) is longer than 32
    agent = _agent(server, calls, tool_choice="required", max_tokens=256)
    result = agents.Runner.run_sync(agent, "Is it fine in Paris?", max_turns=3)
    assert len(calls) >= 1  # the SDK ran the tool on the model's call
    assert isinstance(result.final_output, Verdict)
