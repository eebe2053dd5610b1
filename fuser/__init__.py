"""fuser: a compiler for LLM decoding.

    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig())
    engine.logits(input_ids); engine.generate(input_ids, max_new_tokens=64)
"""

from fuser.config import FuserConfig
from fuser.engine import Engine
from fuser.pipeline import optimize
from fuser.report import Report, SpecStats

__version__ = "0.1.0"
__all__ = ["Engine", "FuserConfig", "Report", "SpecStats", "optimize", "__version__"]
