"""Model-side package: continuous-batching generation engine on transformers models.

Import the pieces you need (`engine.llm_engine.LLMEngine`, `engine.triton.model.TritonGenerationModel`);
this package never imports Falcon, pydantic wire models or tritonclient.
"""
