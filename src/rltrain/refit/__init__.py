"""Weight refit: trainer -> rollout engines after every optimizer step."""
