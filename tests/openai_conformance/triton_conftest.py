"""``tests/conftest.py`` for Triton's OpenAI frontend tests run against plugserve (see
test_triton_openai.py): their fixtures, pointed at one plugserve server.

What is adapted, here only (their test files run unchanged):

* ``server``: a plugserve server on 127.0.0.1 serving scripted decoders
  (tests/support/scripted_decoder.py) in Qwen2.5's tool format (its real chat template's
  markup; the hermes parser, chosen from the template), under Triton's default model name
  ``llama-3.1-8b-instruct``. A decoder answers a fixed script: a chat asking for the weather
  gets the call Triton's assertions expect (``get_current_weather`` for Dallas, TX, in
  fahrenheit), a chat holding the tool's result gets a plain answer.
* ``model``: a forced ``tool_choice`` decodes by its grammar, which a script in another shape
  cannot follow, so the named-choice and ``required`` tests get a model of their own whose
  script is the forced answer's shape (the arguments object; vLLM's ``[{"name",
  "parameters"}]`` array); the server still constrains, parses and streams them.
* ``backend``: ``plugserve``.
* Skipped, with the reason: the tests that start Triton in process (``setup_server``,
  FastAPI's TestClient), which have no plugserve counterpart.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path[:0] = os.environ.get("PLUGSERVE_TEST_SUPPORT", "").split(os.pathsep)

from openai_serving import serving  # noqa: E402
from scripted_decoder import write  # noqa: E402
from tests.utils import OpenAIServer  # noqa: E402

MODEL = "llama-3.1-8b-instruct"
ARGUMENTS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
#: model name -> (the decoder's script, its answer once the tool's result is in the chat)
SCRIPTS = {
    MODEL: (
        "<tool_call>\n"
        + json.dumps({"name": "get_current_weather", "arguments": ARGUMENTS})
        + "\n</tool_call>",
        "It is 98 degrees Fahrenheit in Dallas, Texas.",
    ),
    # compact, as the server's JSON grammar writes it
    f"{MODEL}-named": (json.dumps({**ARGUMENTS, "num_days": 3}, separators=(",", ":")), None),
    f"{MODEL}-required": (
        json.dumps(
            [{"name": "get_current_weather", "parameters": ARGUMENTS}], separators=(",", ":")
        ),
        None,
    ),
}
#: the tests whose forced answer has a shape of its own
FORCED = {
    "test_tool_call_with_named_tool_choice": f"{MODEL}-named",
    "test_tool_call_with_required_tool_choice": f"{MODEL}-required",
}
IN_PROCESS = (
    "starts Triton in process (setup_server / FastAPI TestClient): no plugserve counterpart"
)


def pytest_configure(config):
    config.addinivalue_line("markers", "openai: mark test to run with OpenAI server (subprocess)")
    config.addinivalue_line("markers", "fastapi: mark test to run with the FastAPI app")


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        names = set(item.fixturenames)
        if names & {"fastapi_client_class_scope", "tokenizer_model"}:
            item.add_marker(pytest.mark.skip(reason=IN_PROCESS))


@pytest.fixture(scope="session")
def backend():
    return "plugserve"


@pytest.fixture
def model(request):
    return FORCED.get(request.node.originalname, MODEL)


@pytest.fixture(scope="session")
def tool_call_parser():
    return "auto"


@pytest.fixture(scope="session")
def tokenizer_model():
    pytest.skip(IN_PROCESS)


@pytest.fixture(scope="session")
def fastapi_client_class_scope():
    pytest.skip(IN_PROCESS)


@pytest.fixture(scope="session")
def prompt():
    return "What is machine learning?"


@pytest.fixture(scope="session")
def messages(prompt):
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="session")
def input(prompt):
    return prompt


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    entries = {
        name: (write(root / name, "qwen2_5", script, after_tool=after), "NUMPY")
        for name, (script, after) in SCRIPTS.items()
    }
    with serving(entries) as running:
        yield OpenAIServer(running)
