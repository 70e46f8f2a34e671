//! Reading the layers: `default.toml`, `<env>.toml`, then `SECKILL__*`
//! variables.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::Settings;

impl Settings {
    /// Loads the layers for the environment named by `SECKILL_ENV`.
    pub fn load() -> anyhow::Result<Self> {
        match std::env::var("SECKILL_ENV") {
            Ok(env) => Self::load_env(&env),
            // Unnamed: development, for the README's two commands on a
            // developer's machine, and never beyond loopback (validate).
            Err(_) => Self::load_layers("development", false),
        }
    }

    /// Loads `default.toml`, then `<env>.toml`, then `SECKILL__*` variables,
    /// from the folder in `SECKILL_CONFIG_DIR` (default `config`).
    pub fn load_env(env: &str) -> anyhow::Result<Self> {
        Self::load_layers(env, true)
    }

    fn load_layers(env: &str, named: bool) -> anyhow::Result<Self> {
        let dir = config_dir();
        // The environment is the one named, whether or not a file of its
        // own exists: `staging` without config/staging.toml is staging, not
        // the development that default.toml describes.
        let named = format!("[app]\nenv = {env:?}\nenv_named = {named}\n");
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from(dir.join("default.toml")))
            .add_source(config::File::from(dir.join(format!("{env}.toml"))).required(false))
            .add_source(config::File::from_str(&named, config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix("SECKILL")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()
            .with_context(|| format!("reading configuration from {}", dir.display()))?
            .try_deserialize()
            .context("configuration does not match the expected shape")?;
        settings.validate()?;
        Ok(settings)
    }
}

fn config_dir() -> PathBuf {
    match std::env::var_os("SECKILL_CONFIG_DIR") {
        Some(dir) => PathBuf::from(dir),
        None if Path::new("config/default.toml").exists() => PathBuf::from("config"),
        // Tests and benches run from the crate root, but be kind to `cargo run`
        // from elsewhere in the tree.
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
    }
}
