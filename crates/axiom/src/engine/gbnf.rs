//! llama.cpp's GBNF grammars rewritten in llguidance's Lark syntax, which has the same
//! constructs under other spellings: `::=` becomes `:`, `root` the `start` rule, a character
//! class `[...]` a regex, `.` the regex `/./s`; repetitions `{m,n}` and operators carry over.
//! Each rule is written on one line, since GBNF lets a rule span lines where Lark would not.

use super::constraint::ConstraintError;
use std::collections::HashMap;
use std::fmt::Write;

type Parse<T> = std::result::Result<T, ConstraintError>;

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Name(String),
    Define,
    Literal(String),
    /// A character class: negated, and its characters and ranges.
    Class(bool, Vec<(char, char)>),
    AnyChar,
    /// `(`, `)`, `|`, `*`, `+`, `?`.
    Punct(char),
    /// `{m}`, `{m,}`, `{m,n}`, as written.
    Repeat(String),
}

fn error(message: impl Into<String>) -> ConstraintError {
    ConstraintError(format!("GBNF grammar: {}", message.into()))
}

/// The Lark grammar for `gbnf`, or where `gbnf` is malformed.
pub fn gbnf_to_lark(gbnf: &str) -> Parse<String> {
    let tokens = lex(gbnf)?;
    let mut rules: Vec<(String, Vec<Token>)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        match (&tokens[i], tokens.get(i + 1)) {
            (Token::Name(name), Some(Token::Define)) => {
                rules.push((name.clone(), Vec::new()));
                i += 2;
            }
            (token, _) => match rules.last_mut() {
                Some((_, body)) => {
                    body.push(token.clone());
                    i += 1;
                }
                None => return Err(error("the grammar must start with a rule (`name ::= ...`)")),
            },
        }
    }
    if !rules.iter().any(|(name, _)| name == "root") {
        return Err(error("there is no `root` rule"));
    }
    let names = lark_names(&rules);
    let mut lark = String::new();
    for (name, body) in &rules {
        if body.is_empty() {
            return Err(error(format!("rule `{name}` is empty")));
        }
        let _ = write!(lark, "{}:", names[name.as_str()]);
        for token in body {
            lark.push(' ');
            match token {
                Token::Name(n) => match names.get(n.as_str()) {
                    Some(lark_name) => lark.push_str(lark_name),
                    None => return Err(error(format!("rule `{n}` is used but not defined"))),
                },
                Token::Literal(text) => lark.push_str(&serde_json::Value::from(text.as_str()).to_string()),
                Token::Class(negated, ranges) => {
                    lark.push_str("/[");
                    if *negated {
                        lark.push('^');
                    }
                    for &(from, to) in ranges {
                        let _ = write!(lark, "\\x{{{:x}}}", from as u32);
                        if to != from {
                            let _ = write!(lark, "-\\x{{{:x}}}", to as u32);
                        }
                    }
                    lark.push_str("]/");
                }
                Token::AnyChar => lark.push_str("/./s"),
                Token::Punct(c) => {
                    if matches!(c, '*' | '+' | '?') {
                        // An operator follows its operand directly.
                        lark.pop();
                    }
                    lark.push(*c);
                }
                Token::Repeat(r) => {
                    lark.pop();
                    lark.push_str(r);
                }
                Token::Define => return Err(error("`::=` must follow a rule name")),
            }
        }
        lark.push('\n');
    }
    Ok(lark)
}

/// Lark rule names: `root` is `start`; a name Lark would read otherwise (upper case, a leading
/// digit, the name `start`) gets a lower-case name of its own.
fn lark_names(rules: &[(String, Vec<Token>)]) -> HashMap<&str, String> {
    let mut names = HashMap::new();
    for (i, (name, _)) in rules.iter().enumerate() {
        let plain = name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        let lark = match name.as_str() {
            "root" => "start".to_string(),
            n if plain && n != "start" => n.to_string(),
            n => format!("gbnf-{i}-{}", n.to_ascii_lowercase()),
        };
        names.entry(name.as_str()).or_insert(lark);
    }
    names
}

fn lex(src: &str) -> Parse<Vec<Token>> {
    let mut tokens = Vec::new();
    let mut chars = src.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            ':' => {
                if chars.next() != Some(':') || chars.next() != Some('=') {
                    return Err(error("`:` must start `::=`"));
                }
                tokens.push(Token::Define);
            }
            '"' => {
                let mut text = String::new();
                loop {
                    match chars.next() {
                        None => return Err(error("unterminated string literal")),
                        Some('"') => break,
                        Some('\\') => text.push(escape(&mut chars)?),
                        Some(c) => text.push(c),
                    }
                }
                tokens.push(Token::Literal(text));
            }
            '[' => {
                let negated = chars.next_if_eq(&'^').is_some();
                let mut ranges = Vec::new();
                loop {
                    let from = match chars.next() {
                        None => return Err(error("unterminated character class")),
                        Some(']') => break,
                        Some('\\') => escape(&mut chars)?,
                        Some(c) => c,
                    };
                    let mut to = from;
                    if chars.peek() == Some(&'-') {
                        chars.next();
                        to = match chars.next() {
                            None => return Err(error("unterminated character class")),
                            // A trailing '-' is itself a member.
                            Some(']') => {
                                ranges.push((from, from));
                                ranges.push(('-', '-'));
                                break;
                            }
                            Some('\\') => escape(&mut chars)?,
                            Some(c) => c,
                        };
                        if to < from {
                            return Err(error(format!("character range {from:?}-{to:?} is reversed")));
                        }
                    }
                    ranges.push((from, to));
                }
                tokens.push(Token::Class(negated, ranges));
            }
            '{' => {
                let mut repeat = String::from("{");
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) if c.is_ascii_digit() || c == ',' || c == ' ' => repeat.push(c),
                        _ => return Err(error("a repetition is `{m}`, `{m,}` or `{m,n}`")),
                    }
                }
                repeat.retain(|c| c != ' ');
                repeat.push('}');
                tokens.push(Token::Repeat(repeat));
            }
            '.' => tokens.push(Token::AnyChar),
            '(' | ')' | '|' | '*' | '+' | '?' => tokens.push(Token::Punct(c)),
            c if is_name_char(c) => {
                let mut name = String::from(c);
                while let Some(c) = chars.next_if(|&c| is_name_char(c)) {
                    name.push(c);
                }
                tokens.push(Token::Name(name));
            }
            c => return Err(error(format!("unexpected character {c:?}"))),
        }
    }
    Ok(tokens)
}

/// GBNF rule names: letters, digits, `-` and `_`.
fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// The character after a backslash: `\n`, `\r`, `\t`, `\xHH`, `\uHHHH`, `\UHHHHHHHH`, or the
/// character itself.
fn escape(chars: &mut std::iter::Peekable<std::str::Chars>) -> Parse<char> {
    let hex = |chars: &mut std::iter::Peekable<std::str::Chars>, digits: usize| -> Parse<char> {
        let code: String = chars.take(digits).collect();
        u32::from_str_radix(&code, 16)
            .ok()
            .filter(|_| code.len() == digits)
            .and_then(char::from_u32)
            .ok_or_else(|| error(format!("bad escape code {code:?}")))
    };
    match chars.next() {
        Some('n') => Ok('\n'),
        Some('r') => Ok('\r'),
        Some('t') => Ok('\t'),
        Some('x') => hex(chars, 2),
        Some('u') => hex(chars, 4),
        Some('U') => hex(chars, 8),
        Some(c) => Ok(c),
        None => Err(error("the grammar ends in a backslash")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_become_lark_lines() {
        let gbnf = "# a list\nroot ::= \"[\" item (\",\" item)* \"]\"\nitem ::=\n  [a-z0-9_]{1,5} | \"\\x41\" | Other\nOther ::= [^\\n\"] .\n";
        let lark = gbnf_to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: \"[\" item ( \",\" item )* \"]\"\n\
             item: /[\\x{61}-\\x{7a}\\x{30}-\\x{39}\\x{5f}]/{1,5} | \"A\" | gbnf-2-other\n\
             gbnf-2-other: /[^\\x{a}\\x{22}]/ /./s\n"
        );
    }

    #[test]
    fn malformed_grammars_say_why() {
        let message = |g: &str| gbnf_to_lark(g).unwrap_err().0;
        assert!(message("item ::= \"a\"").contains("no `root` rule"));
        assert!(message("root ::= item").contains("`item` is used but not defined"));
        assert!(message("root ::= \"a").contains("unterminated string"));
        assert!(message("root ::= [z-a]").contains("reversed"));
        assert!(message("\"a\" root ::= \"a\"").contains("must start with a rule"));
    }
}
