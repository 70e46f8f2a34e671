//! Prometheus metrics, served at `GET /metrics` in the text format.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// Every metric the process exports, registered in one registry.
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    /// HTTP requests by route pattern, method and status.
    pub http_requests: IntCounterVec,
    /// HTTP latency by route pattern and method, in seconds.
    pub http_duration: HistogramVec,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> anyhow::Result<Self> {
        let registry = Registry::new_custom(Some("seckill".into()), None)?;
        let http_requests = IntCounterVec::new(
            Opts::new(
                "http_requests_total",
                "HTTP requests by route, method and status",
            ),
            &["route", "method", "status"],
        )?;
        let http_duration = HistogramVec::new(
            HistogramOpts::new("http_request_duration_seconds", "HTTP request latency").buckets(
                vec![
                    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                ],
            ),
            &["route", "method"],
        )?;
        registry.register(Box::new(http_requests.clone()))?;
        registry.register(Box::new(http_duration.clone()))?;
        Ok(Self {
            registry,
            http_requests,
            http_duration,
        })
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> anyhow::Result<String> {
        Ok(prometheus::TextEncoder::new().encode_to_string(&self.registry.gather())?)
    }
}
