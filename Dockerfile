# Multi-stage build: compile in the full Rust image, run in a slim Debian with
# only the runtime libraries, as a non-root user. Not used by the tests.
FROM rust:1-bookworm AS build
WORKDIR /src
RUN apt-get update && apt-get install -y --no-install-recommends libpq-dev && rm -rf /var/lib/apt/lists/*
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
RUN cargo build --release --bin seckill

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libpq5 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home /app seckill
WORKDIR /app
COPY --from=build /src/target/release/seckill /usr/local/bin/seckill
COPY config ./config
ENV SECKILL_CONFIG_DIR=/app/config SECKILL_ENV=production
USER seckill
EXPOSE 8080
ENTRYPOINT ["seckill"]
CMD ["serve"]
