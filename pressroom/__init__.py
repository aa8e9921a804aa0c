"""pressroom: an LLM inference and serving engine."""
from pressroom.config import EngineArgs
from pressroom.engine.arg_utils import AsyncEngineArgs
from pressroom.engine.async_api import AsyncLLMEngine
from pressroom.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from pressroom.engine.classify import (
    ClassificationOutput,
    ClassificationRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pressroom.engine.inputs import TextPrompt, TokensPrompt
from pressroom.engine.llm_engine import LLMEngine
from pressroom.llm import LLM
from pressroom.logger import configure_logging
from pressroom.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pressroom.pooling_params import PoolingParams
from pressroom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

configure_logging()

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams",
           "StructuredOutputsParams", "RequestOutputKind", "TextPrompt", "TokensPrompt", "RequestOutput",
           "CompletionOutput", "PoolingParams", "PoolingRequestOutput", "PoolingOutput", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence", "ClassificationOutput", "ClassificationRequestOutput",
           "ScoringOutput", "ScoringRequestOutput", "__version__"]
