//! One HTTP exchange with a provider, as every adapter reads it: no answer,
//! or an answer cut short, may mean the provider did the work, so both are
//! `Unknown`, never a refusal.

use super::ProviderError;

/// An answer read whole: its status, headers and body.
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Sends `request` and reads its answer whole.
pub async fn exchange(request: reqwest::RequestBuilder) -> Result<Answer, ProviderError> {
    let answer = request
        .send()
        .await
        .map_err(|e| ProviderError::Unknown(format!("no answer: {e}")))?;
    let status = answer.status().as_u16();
    let headers = answer.headers().clone();
    let body = answer
        .bytes()
        .await
        .map_err(|e| ProviderError::Unknown(format!("answer cut short: {e}")))?;
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// A 2xx answer's JSON: one not understood is `Unknown`, since the provider
/// may have done what was asked.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ProviderError> {
    serde_json::from_slice(body)
        .map_err(|e| ProviderError::Unknown(format!("an answer not understood: {e}")))
}
