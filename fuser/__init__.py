"""fuser: a compiler for LLM decoding.

    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig())
    engine.logits(input_ids); engine.generate(input_ids, max_new_tokens=64)
    engine.save("engine_dir"); engine = fuser.load("engine_dir")
"""

from fuser.config import FuserConfig
from fuser.distributed import FollowerError
from fuser.engine import Engine
from fuser.engine_file import EngineFileError
from fuser.pipeline import load, optimize
from fuser.report import Report, SpecStats
from fuser.runtime.scheduler import SamplingParams, Scheduler

__version__ = "0.1.0"
__all__ = ["Engine", "EngineFileError", "FollowerError", "FuserConfig", "Report",
           "SamplingParams", "Scheduler", "SpecStats", "load", "optimize", "__version__"]
