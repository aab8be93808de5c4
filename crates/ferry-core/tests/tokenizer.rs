//! The incremental detokenizer against the fixture's byte-level BPE, where multi-byte characters span tokens.

use std::path::Path;

use ferry_core::loader::{Detokenizer, Tokenizer};

#[test]
fn streamed_pieces_never_split_a_character() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let tokenizer = Tokenizer::load(&dir).unwrap().unwrap();
    let text = "naïve café, 世界 and 🦀 crabs";
    let ids = tokenizer.encode(text, false).unwrap();
    assert!(
        ids.len() > text.chars().count() / 2,
        "expected characters split across tokens"
    );
    let mut detokenizer = Detokenizer::new();
    let mut streamed = String::new();
    for &id in &ids {
        if let Some(piece) = detokenizer.push(&tokenizer, id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "piece {piece:?} holds a broken character");
            streamed.push_str(&piece);
        }
    }
    assert_eq!(streamed, tokenizer.decode(&ids, true).unwrap());
    assert_eq!(streamed, text);
}

#[test]
fn text_held_back_at_the_end_is_released_as_transformers_decodes_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let tokenizer = Tokenizer::load(&dir).unwrap().unwrap();
    let ids = tokenizer.encode("🦀", false).unwrap();
    assert!(ids.len() > 1, "the crab spans several byte tokens");
    let cut = &ids[..ids.len() - 1];
    let mut detokenizer = Detokenizer::new();
    for &id in cut {
        assert_eq!(
            detokenizer.push(&tokenizer, id).unwrap(),
            None,
            "an incomplete character is held"
        );
    }
    let rest = detokenizer.finish(&tokenizer).unwrap();
    assert_eq!(rest, tokenizer.decode(cut, true).unwrap());
    assert!(rest.contains('\u{FFFD}'));
}

#[test]
fn special_tokens_write_their_text_only_when_kept() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
    let tokenizer = Tokenizer::load(&dir).unwrap().unwrap();
    let start = tokenizer.token_id("<|im_start|>").unwrap();
    let mut ids = tokenizer.encode("ferry", false).unwrap();
    ids.push(start);
    ids.extend(tokenizer.encode(" boat", false).unwrap());
    let stream = |mut detokenizer: Detokenizer| -> String {
        let mut text = String::new();
        for &id in &ids {
            text += &detokenizer.push(&tokenizer, id).unwrap().unwrap_or_default();
        }
        text + &detokenizer.finish(&tokenizer).unwrap()
    };
    assert_eq!(stream(Detokenizer::new()), "ferry boat");
    assert_eq!(stream(Detokenizer::keeping_special_tokens()), "ferry<|im_start|> boat");
}
