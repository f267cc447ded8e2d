//! JSON-RPC 2.0, the envelope of every MCP message. The bodies (`params`, `result`) stay
//! [`Value`]s: the proxy forwards what servers and clients send without knowing it, and an
//! envelope built here is always a well-formed one.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The protocol's error codes planarian uses.
pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// The first of the codes left to implementations (a server error).
pub const SERVER_ERROR: i64 = -32000;

/// The literal `"2.0"`: anything else does not parse.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct V2;

impl Serialize for V2 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("2.0")
    }
}

impl<'de> Deserialize<'de> for V2 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = String::deserialize(d)?;
        if v == "2.0" {
            Ok(V2)
        } else {
            Err(serde::de::Error::custom(format!("jsonrpc must be \"2.0\", not {v:?}")))
        }
    }
}

/// A call that wants an answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Request {
    pub jsonrpc: V2,
    pub id: Value,
    pub method: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub params: Value,
}

/// A message that wants none.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Notification {
    pub jsonrpc: V2,
    pub method: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub params: Value,
}

/// An error object.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorObject {
    pub code: i64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// A response: its request's id and a result or an error.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Response {
    pub jsonrpc: V2,
    pub id: Value,
    #[serde(flatten)]
    pub outcome: Outcome,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Result(Value),
    Error(ErrorObject),
}

/// A request `{"jsonrpc":"2.0","id":…,"method":…,"params":…}` (no `params` when null).
pub fn request(id: impl Into<Value>, method: &str, params: Value) -> Value {
    to_value(&Request { jsonrpc: V2, id: id.into(), method: method.into(), params })
}

/// A notification (no id).
pub fn notification(method: &str, params: Value) -> Value {
    to_value(&Notification { jsonrpc: V2, method: method.into(), params })
}

/// A successful response.
pub fn result(id: Value, result: Value) -> Value {
    to_value(&Response { jsonrpc: V2, id, outcome: Outcome::Result(result) })
}

/// An error response (`id` null when the request's could not be read).
pub fn error(id: Value, code: i64, message: impl Into<String>) -> Value {
    to_value(&Response {
        jsonrpc: V2,
        id,
        outcome: Outcome::Error(ErrorObject { code, message: message.into(), data: None }),
    })
}

fn to_value<T: Serialize>(t: &T) -> Value {
    // (these types hold only strings, numbers and Values: they always encode)
    serde_json::to_value(t).expect("a JSON-RPC envelope encodes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelopes_are_exactly_the_protocols() {
        assert_eq!(
            request(1, "tools/call", json!({"name": "x"})),
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x"}})
        );
        assert_eq!(request("a", "ping", Value::Null), json!({"jsonrpc": "2.0", "id": "a", "method": "ping"}));
        assert_eq!(
            notification("notifications/initialized", Value::Null),
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"})
        );
        assert_eq!(result(json!(7), json!({})), json!({"jsonrpc": "2.0", "id": 7, "result": {}}));
        assert_eq!(
            error(Value::Null, PARSE_ERROR, "parse error"),
            json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "parse error"}})
        );
    }

    #[test]
    fn responses_parse_and_other_versions_do_not() {
        let r: Response = serde_json::from_value(
            json!({"jsonrpc": "2.0", "id": 3, "error": {"code": -1, "message": "m", "data": [1]}}),
        )
        .unwrap();
        assert_eq!(r.outcome, Outcome::Error(ErrorObject { code: -1, message: "m".into(), data: Some(json!([1])) }));
        let r: Response = serde_json::from_value(json!({"jsonrpc": "2.0", "id": 3, "result": {"ok": true}})).unwrap();
        assert_eq!(r.outcome, Outcome::Result(json!({"ok": true})));
        assert!(serde_json::from_value::<Request>(json!({"jsonrpc": "1.0", "id": 1, "method": "m"})).is_err());
    }
}
