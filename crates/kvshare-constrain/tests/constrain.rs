//! Masks, consuming, EOS and compile errors over a small hand-made vocabulary.

use kvshare_constrain::{
    fill_masks_parallel, ConstrainError, Grammar, GrammarKind, Matcher, Vocab,
};

const IM_END: u32 = 0;
const IM_START: u32 = 1;
const TOOL_CALL: u32 = 2;
/// Padding rows beyond the token strings (a logits row is longer than the vocabulary).
const PAD: usize = 7;

/// Control tokens, a user-defined `<tool_call>`, every printable ASCII byte and a few merges.
fn tokens() -> (Vec<Vec<u8>>, Vec<bool>) {
    let mut toks: Vec<(Vec<u8>, bool)> = vec![
        (b"<|im_end|>".to_vec(), true),
        (b"<|im_start|>".to_vec(), true),
        (b"<tool_call>".to_vec(), false),
    ];
    toks.extend((0x20u8..0x7f).map(|b| (vec![b], false)));
    toks.push((b"\n".to_vec(), false));
    for s in [
        "{\"", "\":", "\",", "name", "age", "true", "false", "null", "\"}", "Bob", "12", " \"",
    ] {
        toks.push((s.as_bytes().to_vec(), false));
    }
    toks.into_iter().unzip()
}

fn vocab() -> Vocab {
    let (t, s) = tokens();
    let n = t.len();
    Vocab::new(t, s, &[IM_END], n + PAD).unwrap()
}

fn id(text: &str) -> u32 {
    let (t, s) = tokens();
    t.iter()
        .zip(&s)
        .position(|(b, &sp)| !sp && b == text.as_bytes())
        .unwrap_or_else(|| panic!("no token {text:?}")) as u32
}

fn allowed(m: &mut Matcher) -> Vec<u32> {
    let v = m.vocab().clone();
    let mut mask = vec![0u32; v.mask_words()];
    m.fill_mask(&mut mask).unwrap();
    (0..v.vocab_size() as u32)
        .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

fn feed(m: &mut Matcher, text: &[&str]) {
    for t in text {
        m.consume(id(t)).unwrap_or_else(|e| panic!("{t:?}: {e}"));
    }
}

const SCHEMA: &str = r#"{
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": false
}"#;

fn compact(schema: &str) -> String {
    // no free whitespace, so the test can name every allowed token
    let mut v: serde_json::Value = serde_json::from_str(schema).unwrap();
    v["x-guidance"] = serde_json::json!({"whitespace_flexible": false});
    v.to_string()
}

#[test]
fn json_schema_masks_allow_only_valid_continuations() {
    let v = vocab();
    let g = Grammar::compile(&v, GrammarKind::JsonSchema, &compact(SCHEMA)).unwrap();
    let mut m = g.matcher();
    assert_eq!(allowed(&mut m), vec![id("{"), id("{\"")]);
    feed(&mut m, &["{\""]);
    // only the first property's name may start: "n" or "name"
    assert_eq!(allowed(&mut m), vec![id("n"), id("name")]);
    feed(&mut m, &["name", "\":", "\""]);
    let inside = allowed(&mut m);
    assert!(inside.contains(&id("B")) && inside.contains(&id("Bob")));
    assert!(inside.contains(&id("\"")) && !inside.contains(&id("\n")));
    assert!(!inside.contains(&IM_END) && !inside.contains(&TOOL_CALL));
    feed(&mut m, &["Bob", "\","]);
    assert!(!m.is_accepting());
    feed(&mut m, &["\"", "o", "k", "\":"]);
    let mut want = vec![id("f"), id("t"), id("false"), id("true")];
    want.sort();
    assert_eq!(allowed(&mut m), want);
}

#[test]
fn complete_object_then_only_eos() {
    let v = vocab();
    let g = Grammar::compile(&v, GrammarKind::JsonSchema, &compact(SCHEMA)).unwrap();
    let mut m = g.matcher();
    feed(
        &mut m,
        &[
            "{\"", "name", "\":", "\"", "Bob", "\",", "\"", "o", "k", "\":", "true",
        ],
    );
    assert!(!m.is_accepting());
    feed(&mut m, &["}"]);
    assert!(m.is_accepting() && m.is_stopped());
    assert_eq!(allowed(&mut m), vec![IM_END]);
    let err = m.consume(id("}")).unwrap_err();
    assert!(matches!(err, ConstrainError::Rejected { .. }), "{err}");
    m.consume(IM_END).unwrap();
    assert!(m.is_stopped());
    assert_eq!(allowed(&mut m), vec![IM_END]);
    assert!(m.consume(IM_END).is_err(), "nothing after EOS");
}

#[test]
fn eos_allowed_when_accepting_but_not_stopped() {
    let v = vocab();
    let g = Grammar::compile(&v, GrammarKind::Regex, "a+").unwrap();
    let mut m = g.matcher();
    assert!(
        m.consume(IM_END).is_err(),
        "EOS before the output is complete"
    );
    feed(&mut m, &["a"]);
    assert!(m.is_accepting() && !m.is_stopped());
    assert_eq!(allowed(&mut m), vec![IM_END, id("a")]);
    m.consume(IM_END).unwrap();
    assert!(m.is_stopped());
}

#[test]
fn rejected_token_errors_and_leaves_matcher_usable() {
    let v = vocab();
    let g = Grammar::compile(&v, GrammarKind::JsonSchema, SCHEMA).unwrap();
    let mut m = g.matcher();
    let err = m.consume(id("x")).unwrap_err();
    assert!(matches!(err, ConstrainError::Rejected { token, .. } if token == id("x")));
    assert!(err.to_string().contains("not allowed"), "{err}");
    assert!(m.consume(TOOL_CALL).is_err());
    assert!(m.consume(IM_START).is_err());
    assert!(m.consume(v.vocab_size() as u32 - 1).is_err(), "padding row");
    assert!(m.consume(v.vocab_size() as u32).is_err(), "out of range");
    feed(&mut m, &["{"]);
    assert!(m.error().is_none());
}

#[test]
fn unsupported_schema_keywords_error() {
    let v = vocab();
    for (schema, word) in [
        (
            r#"{"type":"string","format":"hostname-ish-unknown"}"#,
            "hostname-ish-unknown",
        ),
        (
            r#"{"type":"object","dependentSchemas":{"a":{}}}"#,
            "dependentSchemas",
        ),
        (r#"{"type":"array","uniqueItems":true}"#, "uniqueItems"),
        (r#"{"not":{"type":"string"}}"#, "not"),
        (
            r#"{"type":"object","properties":{"a":{"type":"array","contains":{}}}}"#,
            "contains",
        ),
        (
            r#"{"oneOf":[{"type":"string"},{"type":"string","maxLength":3}]}"#,
            "oneOf",
        ),
        (
            r#"{"type":"object","x-guidance":{"lenient":true}}"#,
            "lenient",
        ),
    ] {
        match Grammar::compile(&v, GrammarKind::JsonSchema, schema) {
            Err(ConstrainError::Compile(msg)) => {
                assert!(msg.contains(word), "{schema}: {msg}");
                assert!(!msg.contains("coerce_one_of"), "advice to weaken: {msg}");
            }
            Err(e) => panic!("{schema}: wrong error {e:?}"),
            Ok(_) => panic!("{schema} compiled"),
        }
    }
    // keywords outside JSON Schema are annotations, as for any validator
    Grammar::compile(
        &v,
        GrammarKind::JsonSchema,
        r#"{"type":"string","x-note":1}"#,
    )
    .unwrap();
}

#[test]
fn bad_sources_error() {
    let v = vocab();
    let cases = [
        (GrammarKind::JsonSchema, "{not json"),
        (GrammarKind::Lark, "start: foo"),
        (GrammarKind::Lark, "start: <|no_such_token|>"),
        (GrammarKind::Regex, "a(b"),
    ];
    for (kind, src) in cases {
        let r = Grammar::compile(&v, kind, src);
        assert!(matches!(r, Err(ConstrainError::Compile(_))), "{src}");
    }
    assert!(matches!(
        "gbnf".parse::<GrammarKind>(),
        Err(ConstrainError::UnsupportedKind(_))
    ));
    assert!("yaml".parse::<GrammarKind>().is_err());
}

#[test]
fn lark_literal_markup_uses_plain_user_tokens_and_special_tokens() {
    let v = vocab();
    let src = r#"start: "<tool_call>" "\n" %json{"type": "boolean"} "\n" <|im_end|>"#;
    let g = Grammar::compile(&v, GrammarKind::Lark, src).unwrap();
    let mut m = g.matcher();
    let first = allowed(&mut m);
    assert!(first.contains(&TOOL_CALL) && first.contains(&id("<")));
    feed(&mut m, &["<tool_call>", "\n", "true", "\n"]);
    assert!(!m.is_accepting());
    assert_eq!(allowed(&mut m), vec![IM_END]);
    // here EOS is grammar content, not the end of an accepting output
    m.consume(IM_END).unwrap();
    assert!(m.is_accepting() && m.is_stopped());
}

#[test]
fn json_object_and_matchers_are_independent() {
    let v = vocab();
    let g = Grammar::compile(&v, GrammarKind::JsonObject, "").unwrap();
    let mut a = g.matcher();
    let mut b = g.matcher();
    feed(&mut a, &["{", "}"]);
    assert!(a.is_accepting());
    assert!(!b.is_accepting());
    assert!(allowed(&mut b).contains(&id("{")));
}

#[test]
fn parallel_masks_equal_serial_ones() {
    let v = vocab();
    let g = Grammar::compile(&v, GrammarKind::JsonSchema, SCHEMA).unwrap();
    let r = Grammar::compile(&v, GrammarKind::Regex, "(ab)+").unwrap();
    let mut ms = [
        g.matcher(),
        r.matcher(),
        g.matcher(),
        r.matcher(),
        g.matcher(),
    ];
    feed(&mut ms[2], &["{\"", "name"]);
    feed(&mut ms[3], &["a"]);
    let words = v.mask_words();
    let serial: Vec<u32> = ms
        .iter_mut()
        .flat_map(|m| {
            let mut row = vec![0; words];
            m.fill_mask(&mut row).unwrap();
            row
        })
        .collect();
    for threads in [1, 2, 3, 8] {
        let mut out = vec![u32::MAX; ms.len() * words];
        let mut refs: Vec<&mut Matcher> = ms.iter_mut().collect();
        let res = fill_masks_parallel(&mut refs, &mut out, threads);
        assert!(res.iter().all(|r| r.is_ok()));
        assert_eq!(out, serial, "threads={threads}");
    }
    let mut refs: Vec<&mut Matcher> = ms.iter_mut().collect();
    let res = fill_masks_parallel(&mut refs, &mut [0; 3], 2);
    assert!(res
        .iter()
        .all(|r| matches!(r, Err(ConstrainError::MaskSize { .. }))));
}

#[test]
fn eos_tokens_are_never_text() {
    // a user-defined token that is also an end of generation (Gemma's `</s>`)
    let (mut t, mut s) = tokens();
    t.push(b"</s>".to_vec());
    s.push(false);
    let end = t.len() as u32 - 1;
    let n = t.len();
    let v = Vocab::new(t, s, &[IM_END, end], n).unwrap();
    let g = Grammar::compile(&v, GrammarKind::Regex, "<?/?s?>?x").unwrap();
    let mut m = g.matcher();
    assert!(!allowed(&mut m).contains(&end), "as text");
    assert!(m.consume(end).is_err());
    feed(&mut m, &["<", "/", "s", ">", "x"]);
    assert_eq!(allowed(&mut m), vec![IM_END, end], "as the end");
    m.consume(end).unwrap();
}

#[test]
fn vocab_checks_its_arguments() {
    let (t, s) = tokens();
    let n = t.len();
    assert!(Vocab::new(t.clone(), s[1..].to_vec(), &[0], n).is_err());
    assert!(Vocab::new(t.clone(), s.clone(), &[0], n - 1).is_err());
    assert!(Vocab::new(t.clone(), s.clone(), &[n as u32], n).is_err());
    assert!(Vocab::new(t, s, &[], n).is_err());
    let v = vocab();
    assert_eq!(v.mask_words(), (n + PAD).div_ceil(32));
}
