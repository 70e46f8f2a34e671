//! The OpenAPI document, generated from the routes' `#[utoipa::path]`
//! annotations and the request types' `ToSchema` derives, served at
//! `GET /api/v1/openapi.json`. A test below fails when the router
//! (`routes::ROUTES`) and the document disagree in either direction.

use std::sync::LazyLock;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::routes;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "seckill",
        description = "Flash-sale orders: admission in Redis, orders through Kafka into PostgreSQL. \
            Every error is an RFC 9457 problem (application/problem+json) with a stable `code`.",
    ),
    paths(
        routes::orders::place,
        routes::health::live,
        routes::health::ready,
        routes::health::metrics,
        routes::openapi,
        routes::me,
        routes::admin_me,
        routes::activities::create,
        routes::activities::warmup,
        routes::activities::stats,
        routes::activities::end,
        routes::activities::list,
        routes::activities::show,
        routes::activities::token,
        routes::queue::challenge,
        routes::queue::join,
        routes::queue::me,
        routes::queue::leave,
        routes::queue::events,
        routes::queue::draw,
        routes::queue::set_rate,
        routes::orders::list,
        routes::orders::show,
        routes::streams::order_events,
        routes::orders::cancel,
        routes::payments::pay,
        routes::payments::pay_qr,
        routes::payments::notify,
        routes::payments::notify_wechatpay,
        routes::payments::notify_stripe,
        routes::payments::refund,
        routes::payments::statement,
        routes::payments::statements,
        routes::payments::simulate,
        routes::dev_token,
        routes::reconcile::run,
        routes::reconcile::last,
        routes::coupons::create,
        routes::coupons::stats,
        routes::coupons::mine,
        routes::coupons::claim,
        routes::console::root,
        routes::console::file,
    ),
    components(schemas(super::error::Problem)),
    modifiers(&Bearer),
)]
struct ApiDoc;

/// The `bearer` scheme the routes' `security` names: a JWT (HS256) from
/// the identity provider, `seckill token`, or `POST /api/v1/dev/token`.
struct Bearer;

impl Modify for Bearer {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    doc
}

/// The document as JSON, built once.
pub fn json() -> &'static str {
    static JSON: LazyLock<String> = LazyLock::new(|| {
        document()
            .to_pretty_json()
            .expect("the OpenAPI document serialises")
    });
    &JSON
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A router pattern as OpenAPI writes it: `{file:.*}` → `{file}`.
    fn openapi_path(pattern: &str) -> String {
        let mut out = String::with_capacity(pattern.len());
        let mut in_regex = false;
        for c in pattern.chars() {
            match c {
                ':' if out.rfind('{') > out.rfind('}') => in_regex = true,
                '}' => {
                    in_regex = false;
                    out.push(c);
                }
                _ if in_regex => {}
                _ => out.push(c),
            }
        }
        out
    }

    fn documented() -> BTreeSet<(String, String)> {
        let doc: serde_json::Value = serde_json::from_str(json()).unwrap();
        let mut ops = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                ops.insert((method.clone(), path.clone()));
            }
        }
        ops
    }

    fn routed() -> BTreeSet<(String, String)> {
        routes::ROUTES
            .iter()
            .map(|(method, path)| (method.to_string(), openapi_path(path)))
            .collect()
    }

    #[test]
    fn every_route_in_the_router_is_documented() {
        let missing: Vec<_> = routed().difference(&documented()).cloned().collect();
        assert!(
            missing.is_empty(),
            "routes missing from the OpenAPI document: {missing:?}"
        );
    }

    #[test]
    fn every_documented_operation_is_routed() {
        let stale: Vec<_> = documented().difference(&routed()).cloned().collect();
        assert!(stale.is_empty(), "documented but not routed: {stale:?}");
    }

    #[test]
    fn no_two_routes_share_a_path() {
        let paths: BTreeSet<_> = routes::RESOURCES.iter().collect();
        assert_eq!(
            paths.len(),
            routes::RESOURCES.len(),
            "a path registered twice"
        );
        let methods: BTreeSet<_> = routes::ROUTES.iter().collect();
        assert_eq!(methods.len(), routes::ROUTES.len(), "a route listed twice");
    }

    #[test]
    fn router_patterns_read_as_openapi_paths() {
        assert_eq!(openapi_path("/console/{file:.*}"), "/console/{file}");
        assert_eq!(openapi_path("/a/{id}/b"), "/a/{id}/b");
    }

    #[test]
    fn every_error_answer_is_a_problem() {
        let doc: serde_json::Value = serde_json::from_str(json()).unwrap();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (status, response) in op["responses"].as_object().unwrap() {
                    if status.starts_with('4') || status.starts_with('5') {
                        let content = response["content"].as_object();
                        // A provider's callback is answered in its own shape
                        // (and a 404 may also be a problem: no such route).
                        let problem = content.and_then(|c| {
                            c.get("application/problem+json").or_else(|| {
                                path.starts_with("/api/v1/payments/notify/")
                                    .then(|| c.get("application/json"))
                                    .flatten()
                            })
                        });
                        assert!(
                            problem.is_some(),
                            "{method} {path} {status} is not documented as a problem"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn secured_operations_name_the_bearer_scheme() {
        let doc: serde_json::Value = serde_json::from_str(json()).unwrap();
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        let me = &doc["paths"]["/api/v1/me"]["get"];
        assert!(me["security"][0]["bearer"].is_array(), "{me}");
    }
}
