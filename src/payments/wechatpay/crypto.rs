//! The cryptography of WeChat Pay API v3: `WECHATPAY2-SHA256-RSA2048`
//! request signatures with the merchant key, the platform's signatures on
//! answers and callbacks (verified with any of several public keys, chosen
//! by serial), and `AEAD_AES_256_GCM` resources under the APIv3 key.

use std::collections::HashMap;
use std::path::Path;

use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit};
use anyhow::{Context, bail};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use rsa::pkcs1v15::{Signature, SigningKey, VerifyingKey};
use rsa::pkcs8::{DecodePrivateKey, DecodePublicKey};
use rsa::signature::{SignatureEncoding, Signer, Verifier};
use rsa::{PrivateKey, PublicKey};
use sha2::Sha256;

/// The scheme of the `Authorization` header and of `Wechatpay-Signature-Type`.
pub const SCHEME: &str = "WECHATPAY2-SHA256-RSA2048";

/// The merchant's side: signs requests.
pub struct MerchantSigner {
    mchid: String,
    serial: String,
    key: SigningKey<Sha256>,
}

/// The message a request signature covers: method, the path with its
/// query, timestamp, nonce and body, each followed by a newline.
pub fn request_message(
    method: &str,
    path_and_query: &str,
    ts: i64,
    nonce: &str,
    body: &str,
) -> String {
    format!("{method}\n{path_and_query}\n{ts}\n{nonce}\n{body}\n")
}

/// The message an answer's or a callback's signature covers.
pub fn response_message(ts: &str, nonce: &str, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(body.len() + 64);
    m.extend_from_slice(ts.as_bytes());
    m.push(b'\n');
    m.extend_from_slice(nonce.as_bytes());
    m.push(b'\n');
    m.extend_from_slice(body);
    m.push(b'\n');
    m
}

impl MerchantSigner {
    /// From the merchant's PKCS#8 PEM private key.
    pub fn from_pem(mchid: &str, serial: &str, pem: &str) -> anyhow::Result<Self> {
        let key = PrivateKey::from_pkcs8_pem(pem)
            .map_err(|e| anyhow::anyhow!("the merchant key is not a PKCS#8 RSA key: {e}"))?;
        Ok(Self {
            mchid: mchid.to_owned(),
            serial: serial.to_owned(),
            key: SigningKey::new(key),
        })
    }

    /// Base64 of the RSA-SHA256 (PKCS#1 v1.5) signature of `message`.
    pub fn sign(&self, message: &[u8]) -> String {
        B64.encode(self.key.sign(message).to_bytes())
    }

    /// The `Authorization` header of a request.
    pub fn authorization(
        &self,
        method: &str,
        path_and_query: &str,
        ts: i64,
        nonce: &str,
        body: &str,
    ) -> String {
        let signature =
            self.sign(request_message(method, path_and_query, ts, nonce, body).as_bytes());
        format!(
            "{SCHEME} mchid=\"{}\",nonce_str=\"{nonce}\",timestamp=\"{ts}\",serial_no=\"{}\",signature=\"{signature}\"",
            self.mchid, self.serial
        )
    }
}

/// WeChat Pay's public keys, by serial: every one of them is trusted, so a
/// new key can be loaded before the old one is retired.
#[derive(Default)]
pub struct PlatformKeys {
    keys: HashMap<String, VerifyingKey<Sha256>>,
}

/// Why a platform signature was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyError {
    UnknownSerial(String),
    Malformed,
    Mismatch,
}

impl PlatformKeys {
    /// Adds the SPKI PEM public key of `serial`.
    pub fn add_pem(&mut self, serial: &str, pem: &str) -> anyhow::Result<()> {
        let key = PublicKey::from_public_key_pem(pem)
            .map_err(|e| anyhow::anyhow!("{serial}: not an SPKI PEM RSA public key: {e}"))?;
        self.keys.insert(serial.to_owned(), VerifyingKey::new(key));
        Ok(())
    }

    /// Every `<serial>.pem` of `dir`.
    pub fn load_dir(dir: &Path) -> anyhow::Result<Self> {
        let mut keys = Self::default();
        let entries = std::fs::read_dir(dir)
            .with_context(|| format!("reading WeChat Pay public keys from {}", dir.display()))?;
        for entry in entries {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("pem") {
                continue;
            }
            let Some(serial) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let pem = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            keys.add_pem(serial, &pem)?;
        }
        if keys.keys.is_empty() {
            bail!("no <serial>.pem public key in {}", dir.display());
        }
        Ok(keys)
    }

    /// Checks `signature` (base64) over `message` with the key of `serial`.
    pub fn verify(&self, serial: &str, message: &[u8], signature: &str) -> Result<(), VerifyError> {
        let key = self
            .keys
            .get(serial)
            .ok_or_else(|| VerifyError::UnknownSerial(serial.to_owned()))?;
        let bytes = B64.decode(signature).map_err(|_| VerifyError::Malformed)?;
        let signature =
            Signature::try_from(bytes.as_slice()).map_err(|_| VerifyError::Malformed)?;
        key.verify(message, &signature)
            .map_err(|_| VerifyError::Mismatch)
    }
}

/// `AEAD_AES_256_GCM` under the APIv3 key.
pub struct ApiV3Cipher {
    cipher: Aes256Gcm,
}

impl ApiV3Cipher {
    /// The APIv3 key is 32 bytes (ASCII, as the merchant platform sets it).
    pub fn new(key: &[u8]) -> anyhow::Result<Self> {
        if key.len() != 32 {
            bail!("the APIv3 key must be 32 bytes, not {}", key.len());
        }
        Ok(Self {
            cipher: Aes256Gcm::new_from_slice(key)
                .map_err(|_| anyhow::anyhow!("a bad APIv3 key"))?,
        })
    }

    /// The plaintext of base64 `ciphertext` (tag appended), or `None` when
    /// the key, nonce, associated data or ciphertext is not the one sealed.
    pub fn decrypt(
        &self,
        associated_data: &[u8],
        nonce: &[u8],
        ciphertext: &str,
    ) -> Option<Vec<u8>> {
        let nonce = aes_gcm::Nonce::try_from(nonce).ok()?;
        let msg = B64.decode(ciphertext).ok()?;
        self.cipher
            .decrypt(
                &nonce,
                Payload {
                    msg: &msg,
                    aad: associated_data,
                },
            )
            .ok()
    }

    /// Base64 of the sealed `plaintext` (what WeChat Pay sends; the
    /// simulator seals its callbacks with it).
    pub fn encrypt(
        &self,
        associated_data: &[u8],
        nonce: &[u8],
        plaintext: &[u8],
    ) -> Option<String> {
        let nonce = aes_gcm::Nonce::try_from(nonce).ok()?;
        let sealed = self
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: plaintext,
                    aad: associated_data,
                },
            )
            .ok()?;
        Some(B64.encode(sealed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector published in the official wechatpay-java SDK's
    /// `AeadAesCipherTest` (its APIv3 key, nonce, associated data and
    /// sealed "message").
    #[test]
    fn the_sdk_published_aead_vector_opens_and_seals_the_same() {
        let cipher = ApiV3Cipher::new(b"a7cde1ZJB1kG2e7VfTs3jQzaWizur8Gb").unwrap();
        let sealed = "ulwSiIajGClcvcOYvOQ7+l+0PAbzzwI=";
        assert_eq!(
            cipher
                .decrypt(b"associatedData", b"uluk4a9R25RW", sealed)
                .as_deref(),
            Some(&b"message"[..])
        );
        assert_eq!(
            cipher
                .encrypt(b"associatedData", b"uluk4a9R25RW", b"message")
                .as_deref(),
            Some(sealed)
        );
        assert_eq!(
            cipher.decrypt(b"bad-associatedData", b"uluk4a9R25RW", sealed),
            None
        );
        assert_eq!(
            cipher.decrypt(b"associatedData", b"bad-4a9R25RW", sealed),
            None
        );
        assert_eq!(
            cipher.decrypt(b"associatedData", b"uluk4a9R25RW", "AAAA"),
            None
        );
        assert!(ApiV3Cipher::new(b"short").is_err());
    }

    #[test]
    fn the_request_message_is_five_lines_each_ended() {
        assert_eq!(
            request_message("GET", "/v3/x?mchid=1", 1554208460, "593BEC0C", ""),
            "GET\n/v3/x?mchid=1\n1554208460\n593BEC0C\n\n"
        );
        assert_eq!(response_message("1", "n", b"{}"), b"1\nn\n{}\n");
    }

    #[test]
    fn a_signature_verifies_only_under_its_serial_and_its_message() {
        use rsa::Generate;
        use rsa::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
        let private = PrivateKey::generate();
        let pem = private.to_pkcs8_pem(LineEnding::LF).unwrap();
        let public = private
            .to_public_key()
            .to_public_key_pem(LineEnding::LF)
            .unwrap();
        let signer = MerchantSigner::from_pem("1900000001", "SERIAL", &pem).unwrap();
        let mut keys = PlatformKeys::default();
        keys.add_pem("SERIAL", &public).unwrap();
        let sig = signer.sign(b"hello\n");
        assert_eq!(keys.verify("SERIAL", b"hello\n", &sig), Ok(()));
        assert_eq!(
            keys.verify("SERIAL", b"hellO\n", &sig),
            Err(VerifyError::Mismatch)
        );
        assert_eq!(
            keys.verify("OTHER", b"hello\n", &sig),
            Err(VerifyError::UnknownSerial("OTHER".into()))
        );
        assert_eq!(
            keys.verify("SERIAL", b"hello\n", "!!"),
            Err(VerifyError::Malformed)
        );
        let auth = signer.authorization("POST", "/v3/pay/transactions/native", 1, "N", "{}");
        assert!(auth.starts_with("WECHATPAY2-SHA256-RSA2048 mchid=\"1900000001\",nonce_str=\"N\",timestamp=\"1\",serial_no=\"SERIAL\",signature=\""));
    }
}
