#!/bin/sh
# The Triton image's entry point: tritonserver on a model repository, with the stack's usual options.
#
#   MODEL_REPOSITORY   the repository to serve (default: the image's /opt/sie/model_repository). Mount your own,
#                      written by `python -m devstack.add_model <folder> --repository <dir> --kind gpu
#                      --model-path /models/<folder>` with the model folders mounted under /models.
#   TRITON_ARGS        more tritonserver options, e.g. --exit-on-error=false: a model the engine refuses then stays
#                      UNAVAILABLE with its reason while the others serve (Triton's default stops the server at start;
#                      /v2/health/ready, this image's health check, stays failing while any model is unavailable).
#   TRITON_HTTP_PORT / TRITON_GRPC_PORT / TRITON_METRICS_PORT   the three ports (8000 / 8001 / 8002)
#
# exec: tritonserver gets SIGTERM directly.
# shellcheck disable=SC2086  # TRITON_ARGS is a list of options
exec tritonserver --model-repository="${MODEL_REPOSITORY:-/opt/sie/model_repository}" \
    --http-port="${TRITON_HTTP_PORT:-8000}" --grpc-port="${TRITON_GRPC_PORT:-8001}" \
    --metrics-port="${TRITON_METRICS_PORT:-8002}" \
    --grpc-http2-min-recv-ping-interval-without-data=10000 --grpc-http2-max-ping-strikes=0 \
    --model-control-mode=explicit --load-model='*' ${TRITON_ARGS:-}
