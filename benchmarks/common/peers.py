"""llama.cpp as a peer: peer_llama_cpp.py run by a Python that has llama-cpp-python (never a torchqkit dependency),
given by --peers-python or the TORCHQKIT_PEER_PYTHON environment variable; without one the peer rows are skipped and
the run says so."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "peer_llama_cpp.py"
ENV = "TORCHQKIT_PEER_PYTHON"


def add_option(p) -> None:
    p.add_argument("--peers-python", "--peer-python", dest="peers_python", default=os.environ.get(ENV, ""),
                   help=f"a Python with llama-cpp-python for the llama.cpp rows (default: ${ENV}; '' skips them)")


def run(python: str, gguf, *args: str) -> dict:
    """peer_llama_cpp.py's JSON, or {'note': why there is none}."""
    if not python:
        return {"note": f"skipped (no --peers-python / ${ENV})"}
    if gguf is None:
        return {"note": "skipped (--quick: no GGUF file)"}
    if not Path(python).is_file():
        return {"note": f"no Python at {python} (a venv with llama-cpp-python)"}
    done = subprocess.run([python, str(SCRIPT), str(gguf), *args], capture_output=True, text=True)
    if done.returncode != 0:
        err = done.stderr.strip()
        return {"note": f"failed: {err.splitlines()[-1] if err else done.returncode}"}
    return json.loads(done.stdout)


def simd(system_info: str) -> str:
    """The x86 vector extensions a llama.cpp build was compiled for ("AVX2 AVX512 ..."), from its system info line: a
    build for the machine's best ISA and an AVX2-only build decode at different speeds on the same CPU."""
    on = re.findall(r"\b(AVX\w*|AMX\w*) = 1", system_info)
    return " ".join(on) if on else "SIMD unknown"
