//! The functions and filters chat templates call that Jinja lacks, written to give exactly what Python gives
//! transformers: `tojson` (Python's `json.dumps`), `strftime_now` (`time.strftime` in UTC), and `python_json` for the
//! JSON text templates that concatenate arguments expect.

use minijinja::value::{Kwargs, Value as JinjaValue};

/// `tojson` as transformers defines it for templates: Python's `json.dumps(x, ensure_ascii=False)` with its
/// `", "` and `": "` separators, or pretty-printed with `indent` (positional or named). `ensure_ascii=False`, which
/// GLM's template spells out, is the default; other keyword arguments are refused.
pub(super) fn python_tojson(
    value: JinjaValue,
    indent: Option<usize>,
    kwargs: Kwargs,
) -> Result<String, minijinja::Error> {
    let indent = indent.or(kwargs.get::<Option<usize>>("indent")?);
    if kwargs.get::<Option<bool>>("ensure_ascii")? == Some(true) {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            "tojson(ensure_ascii=True) is not supported",
        ));
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(out)
}

/// transformers' `strftime_now(format)`: the current UTC time formatted by a C `strftime` format (the directives
/// chat templates use: `%Y %m %d %e %H %M %S %b %B %a %A %j %y %%`).
pub(super) fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(seconds, &format)
}

/// `format` for the UTC time `seconds` after the Unix epoch.
fn format_utc(seconds: u64, format: &str) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const WEEKDAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (seconds / 86_400) as i64;
    let (year, month, day) = civil_from_days(days);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before_month = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let day_of_year = before_month + day + u32::from(leap && month > 2);
    // 1970-01-01 was a Thursday.
    let weekday = WEEKDAYS[(days + 3).rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let time = seconds % 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:>2}"),
            Some('j') => out += &format!("{day_of_year:03}"),
            Some('H') => out += &format!("{:02}", time / 3600),
            Some('M') => out += &format!("{:02}", time / 60 % 60),
            Some('S') => out += &format!("{:02}", time % 60),
            Some('b') => out += &month_name[..3],
            Some('B') => out += month_name,
            Some('a') => out += &weekday[..3],
            Some('A') => out += weekday,
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// The proleptic Gregorian (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `value` as the templates' `tojson` (and Python's `json.dumps`) writes it: `", "` and `": "` between items.
pub fn python_json(value: &serde_json::Value) -> String {
    let mut out = String::new();
    write_python_json(value, None, 0, &mut out);
    out
}

fn write_python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_separator = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_utc_dates_as_python_does() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(format_utc(t, "%Y-%m-%d %H:%M:%S").unwrap(), "2024-02-29 13:05:09");
        assert_eq!(
            format_utc(t, "%d %b %Y, %A %j %y%%").unwrap(),
            "29 Feb 2024, Thursday 060 24%"
        );
        assert_eq!(format_utc(0, "%a %B %e").unwrap(), "Thu January  1");
        assert!(format_utc(t, "%Q").is_err());
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v = JinjaValue::from_serialize(serde_json::json!({"a": [1, "x<y"], "b": {}}));
        let no_kwargs = || Kwargs::from_iter(std::iter::empty::<(&str, JinjaValue)>());
        assert_eq!(
            python_tojson(v.clone(), None, no_kwargs()).unwrap(),
            r#"{"a": [1, "x<y"], "b": {}}"#
        );
        assert_eq!(
            python_tojson(v, Some(2), no_kwargs()).unwrap(),
            "{\n  \"a\": [\n    1,\n    \"x<y\"\n  ],\n  \"b\": {}\n}"
        );
    }
}
