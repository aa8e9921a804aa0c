"""Bodies of vLLM's classification route (/classify) and Cohere's embed API (/v2/embed), as vLLM 0.32 serves them,
and /v1/embeddings' and /pooling's with vLLM 0.32's `use_activation`."""
from __future__ import annotations

import builtins
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from pressroom.entrypoints.openai.limits import RequestCost
from pressroom.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EngineInt,
    OpenAIModel,
    PoolingInput,
    PoolingRequest,
    Priority,
    Unsupported,
    UsageInfo,
    random_id,
)


def _set(value: Any) -> bool:
    return value is not None


def _count(value: str | list) -> int:
    return 1 if isinstance(value, str) or (value and isinstance(value[0], int)) else len(value)


class ClassificationRequest(OpenAIModel):
    """vLLM's /classify, its completion form: `input` as /v1/embeddings takes it."""
    model: str | None = None
    input: PoolingInput
    user: str | None = None
    use_activation: bool | None = None  # False: the class logits; None or True: the probabilities
    priority: Priority | None = None
    unsupported_fields: ClassVar[Unsupported] = {
        "messages": (_set, "/classify takes `input` (texts or token ids); the chat form is not supported"),
        "truncate_prompt_tokens": (_set, "inputs are classified whole (a too-long input is a 400)"),
    }

    def cost(self) -> RequestCost:
        return RequestCost(prompts=_count(self.input), prompts_param="input", generates=False)

    @classmethod
    def raw_cost(cls, data: dict[str, Any]) -> RequestCost | None:
        value = data.get("input")
        if not isinstance(value, list):
            return None
        return RequestCost(prompts=_count(value), prompts_param="input", generates=False)


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


# ---- Cohere's /v2/embed ----

CohereEmbeddingType = Literal["float", "binary", "ubinary", "base64"]


class CohereEmbedContent(BaseModel):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, str] | None = None


class CohereEmbedInput(BaseModel):
    content: list[CohereEmbedContent]


class CohereEmbedRequest(OpenAIModel):
    model: str | None = None
    input_type: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[CohereEmbedInput] | None = None
    output_dimension: EngineInt | None = None
    embedding_types: list[CohereEmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: EngineInt | None = None
    priority: Priority = 0
    unsupported_fields: ClassVar[Unsupported] = {
        "images": (_set, "pressroom's models read text only"),
    }

    @model_validator(mode="after")
    def _one_input_field(self) -> CohereEmbedRequest:
        given = [f for f in (self.texts, self.images, self.inputs) if f is not None]
        if len(given) != 1 or not given[0]:
            raise ValueError("Exactly one of texts, images, or inputs must be provided, and it must be non-empty")
        return self

    def input_texts(self) -> list[str]:
        """The texts to embed: `texts`, or each input's text parts joined (an image part is refused)."""
        if self.texts is not None:
            return list(self.texts)
        out = []
        for item in self.inputs or []:
            if any(part.type != "text" for part in item.content):
                raise ValueError("inputs hold an image_url part: pressroom's models read text only.")
            out.append("".join(part.text or "" for part in item.content))
        return out

    def cost(self) -> RequestCost:
        return RequestCost(prompts=len(self.texts or self.inputs or []), prompts_param="texts", generates=False)


class CohereEmbeddings(BaseModel):
    float: list[list[builtins.float]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereApiVersion(BaseModel):
    version: str = "2"


class CohereBilledUnits(BaseModel):
    input_tokens: int | None = None
    image_tokens: int | None = None


class CohereMeta(BaseModel):
    api_version: CohereApiVersion = Field(default_factory=CohereApiVersion)
    billed_units: CohereBilledUnits | None = None


class CohereEmbedResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    embeddings: CohereEmbeddings
    texts: list[str] | None = None
    meta: CohereMeta | None = None
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


# ---- vLLM 0.32's name for an embedding's normalisation on /v1/embeddings and /pooling ----

class VllmEmbeddingRequest(EmbeddingRequest):
    use_activation: bool | None = None  # vLLM 0.32's name for `normalize` (which wins where both are set)


class VllmPoolingRequest(PoolingRequest):
    use_activation: bool | None = None
