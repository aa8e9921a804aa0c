"""pressroom: an LLM inference and serving engine."""
from pressroom.config import EngineArgs
from pressroom.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from pressroom.engine.llm_engine import LLMEngine
from pressroom.llm import LLM
from pressroom.logger import configure_logging
from pressroom.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import BeamSearchParams, SamplingParams

configure_logging()

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "PoolingParams",
           "PoolingRequestOutput", "PoolingOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "__version__"]
