"""llama.cpp for the suite (llama-cpp-python, which ships only as source): built once, before the tests start,
by `./run test` (a build inside a test fixture ran under the per-test timeout: 663 s on a fresh 2-core AVX2
machine). The suite's fixture imports it, and builds it itself only when this did not run.

    python tests/setup_llama_cpp.py     # prints one line before and one after; exits 0 even if the build fails
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

# built with the machine's compiler, then pip's wheel cache has it. GGML_NATIVE=OFF so a cached wheel runs on any
# x86-64 CPU, not only the builder's
LLAMA_CPP_CMAKE = "-DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF"
REQUIREMENT = "llama-cpp-python"


def install() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", REQUIREMENT],
                          capture_output=True, text=True, timeout=3600, env={**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE})


def main() -> int:
    if importlib.util.find_spec("llama_cpp") is not None:
        return 0
    print("building llama.cpp for the tests (llama-cpp-python from source, once; about 11 minutes on 2 AVX2 cores) "
          "...", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = install()
    took = time.monotonic() - started
    if done.returncode == 0:
        print(f"llama.cpp built in {took:.0f} s", file=sys.stderr)
    else:  # the tests that need it say so (and fail under TUNEBENCH_STRICT=1)
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"llama.cpp could not be built ({took:.0f} s): {tail}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
