//! The responses the server keeps (OpenAI's `store`, on unless a request says false), for `previous_response_id`
//! and `GET`/`DELETE /v1/responses/{id}`. Each keeps only what its request added: its own `input` items, its response
//! object (whose `output` items come back as input) and the id of the response it continued, so a conversation of
//! n turns costs its items once, not n times. The oldest go first once they outgrow a byte budget; a conversation
//! whose earlier response went is refused by name, never answered without it.

use std::collections::{HashMap, VecDeque};

use serde_json::Value;

/// What the kept responses may take, in bytes of their JSON text.
pub const STORE_BYTES: usize = 256 << 20;

struct Stored {
    previous: Option<String>,
    input: Vec<Value>,
    object: Value,
    bytes: usize,
}

pub struct ResponseStore {
    responses: HashMap<String, Stored>,
    /// Ids, oldest first (a deleted one stays here until its turn to go, and is then skipped).
    order: VecDeque<String>,
    bytes: usize,
    budget: usize,
}

impl ResponseStore {
    pub fn new(budget: usize) -> Self {
        ResponseStore {
            responses: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            budget,
        }
    }

    /// Keeps the response `object` (its id is the key), which continued `previous` with `input`, evicting the oldest
    /// ones past the budget; one that alone outgrows the budget is not kept. A response kept again (a background
    /// one, in progress, then ended) replaces what was kept.
    pub fn insert(&mut self, previous: Option<String>, input: Vec<Value>, object: Value) {
        let Some(id) = object["id"].as_str().map(str::to_string) else {
            return;
        };
        if self.remove(&id) {
            self.order.retain(|kept| kept != &id);
        }
        let bytes = input.iter().map(|item| item.to_string().len()).sum::<usize>() + object.to_string().len();
        if bytes > self.budget {
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.remove(&oldest);
        }
        // Deleted ids wait in `order` for their turn to go; a server that keeps deleting must not pile them up.
        if self.order.len() > 2 * self.responses.len() + 64 {
            let responses = &self.responses;
            self.order.retain(|id| responses.contains_key(id));
        }
        self.bytes += bytes;
        self.order.push_back(id.clone());
        self.responses.insert(
            id,
            Stored {
                previous,
                input,
                object,
                bytes,
            },
        );
    }

    /// The response object kept as `id`.
    pub fn get(&self, id: &str) -> Option<&Value> {
        self.responses.get(id).map(|stored| &stored.object)
    }

    /// The input items response `id`'s own request sent (not those of the responses it continued).
    pub fn input(&self, id: &str) -> Option<&[Value]> {
        self.responses.get(id).map(|stored| stored.input.as_slice())
    }

    /// Replaces the object kept as `id` (its input and the response it continued stay); false if it is not kept.
    pub fn replace(&mut self, id: &str, object: Value) -> bool {
        let Some(stored) = self.responses.get(id) else {
            return false;
        };
        let (previous, input) = (stored.previous.clone(), stored.input.clone());
        self.insert(previous, input, object);
        true
    }

    /// Forgets `id`; false if it was not kept.
    pub fn remove(&mut self, id: &str) -> bool {
        match self.responses.remove(id) {
            Some(stored) => {
                self.bytes -= stored.bytes;
                true
            }
            None => false,
        }
    }

    /// The conversation up to and including response `id`, as input items: every earlier turn's input and output
    /// in order. An error naming the response that is not kept (`id` itself or one it continued), or `id` when it is
    /// still being generated in the background (its output is not there yet).
    pub fn conversation(&self, id: &str) -> Result<Vec<Value>, String> {
        if self.get(id).is_some_and(|object| object["status"] == "in_progress") {
            return Err(format!("the response {id:?} is still in progress"));
        }
        let mut chain = vec![];
        let mut next = Some(id);
        while let Some(id) = next {
            let stored = self
                .responses
                .get(id)
                .ok_or_else(|| format!("no response with id {id:?} is kept"))?;
            chain.push(stored);
            next = stored.previous.as_deref();
        }
        let mut items = vec![];
        for stored in chain.into_iter().rev() {
            items.extend(stored.input.iter().cloned());
            if let Some(output) = stored.object["output"].as_array() {
                items.extend(output.iter().cloned());
            }
        }
        Ok(items)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn response(id: &str, text: &str) -> Value {
        json!({"id": id, "object": "response", "output": [{"type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": text}]}]})
    }

    fn user(text: &str) -> Vec<Value> {
        vec![json!({"role": "user", "content": text})]
    }

    /// A store with room for two small responses, holding one (r1), and the bytes one takes.
    fn room_for_two() -> (ResponseStore, usize) {
        let one = {
            let mut store = ResponseStore::new(STORE_BYTES);
            store.insert(None, user("hi"), response("r1", "hello"));
            store.bytes
        };
        let mut store = ResponseStore::new(2 * one + 10);
        store.insert(None, user("hi"), response("r1", "hello"));
        (store, one)
    }

    #[test]
    fn a_conversation_is_every_turns_input_and_output_in_order() {
        let mut store = ResponseStore::new(STORE_BYTES);
        store.insert(None, user("hi"), response("r1", "hello"));
        store.insert(Some("r1".into()), user("and?"), response("r2", "more"));
        let items = store.conversation("r2").unwrap();
        let texts: Vec<&str> = items
            .iter()
            .map(|item| {
                item["content"]
                    .as_str()
                    .or(item["content"][0]["text"].as_str())
                    .unwrap()
            })
            .collect();
        assert_eq!(texts, ["hi", "hello", "and?", "more"]);
        assert_eq!(store.get("r1").unwrap()["output"][0]["content"][0]["text"], "hello");
        assert!(store.conversation("r3").unwrap_err().contains("\"r3\""));
    }

    #[test]
    fn the_oldest_go_past_the_budget_and_a_broken_chain_is_an_error() {
        let (mut store, one) = room_for_two();
        store.insert(Some("r1".into()), user("hi"), response("r2", "hello"));
        store.insert(Some("r2".into()), user("hi"), response("r3", "hello"));
        assert!(store.get("r1").is_none() && store.get("r2").is_some() && store.get("r3").is_some());
        assert!(store.conversation("r3").unwrap_err().contains("\"r1\""));
        assert!(store.remove("r3") && !store.remove("r3"));
        assert!(store.bytes <= one + 10);
        // A response larger than the whole budget is not kept, and evicts nothing.
        store.insert(None, user(&"x".repeat(3 * one)), response("big", "y"));
        assert!(store.get("big").is_none() && store.get("r2").is_some());
    }

    #[test]
    fn a_response_kept_again_replaces_itself_and_keeps_its_place_in_the_conversation() {
        let (mut store, one) = room_for_two();
        store.insert(Some("r1".into()), user("hi"), response("r2", "....."));
        // r2 ended: its object replaced, its input and the response it continued kept, its bytes counted once.
        assert!(store.replace("r2", response("r2", "hello")));
        assert_eq!(store.bytes, 2 * one);
        assert_eq!(store.get("r2").unwrap()["output"][0]["content"][0]["text"], "hello");
        assert_eq!(store.conversation("r2").unwrap().len(), 4);
        // The next one evicts the oldest, r1, not the replaced r2.
        store.insert(Some("r2".into()), user("hi"), response("r3", "hello"));
        assert!(store.get("r1").is_none() && store.get("r2").is_some() && store.get("r3").is_some());
        assert!(!store.replace("r1", response("r1", "x")), "r1 went");
        // A response still in progress cannot be continued yet.
        let mut running = response("r4", "");
        running["status"] = "in_progress".into();
        store.insert(Some("r3".into()), user("hi"), running);
        assert!(store.conversation("r4").unwrap_err().contains("in progress"));
    }

    #[test]
    fn deleted_responses_do_not_pile_up() {
        let mut store = ResponseStore::new(STORE_BYTES);
        for i in 0..10_000 {
            let id = format!("r{i}");
            store.insert(None, user("hi"), response(&id, "hello"));
            assert!(store.remove(&id));
        }
        assert!(store.order.len() <= 65, "{}", store.order.len());
        assert_eq!(store.bytes, 0);
    }
}
