//! The agent's SQL, read with the real PostgreSQL grammar (libpg_query): which statements only
//! read, which can be made compensable, and the rewrite that makes them so.
//!
//! A compensable INSERT/UPDATE/DELETE (and INSERT … ON CONFLICT) becomes ONE statement: the
//! original runs in a data-modifying CTE whose RETURNING also yields the row's after-image and
//! key; a second CTE writes those, with the before-image, into `planarian.undo` — in the same
//! transaction as the change, so there is never a change without its undo record. All parts of a
//! statement see the snapshot taken before it, so the before-image is simply the row as the
//! table held it. The outer SELECT returns exactly the columns the original RETURNING named (or
//! no rows, like a DML without RETURNING).

use crate::error::{Error, Result};
use pg_query::protobuf::{self, Node};
use pg_query::{DeparseOptions, NodeEnum};

/// What to do with one SQL text.
#[derive(Debug)]
pub enum Class {
    /// Pass through (the functions it calls still have to be checked against the catalog).
    ReadOnly { functions: Vec<String> },
    /// Rewrite, then pass through under the proxy lock.
    Write(Statement),
    /// DDL whose inverse is known: recorded before it runs, undone by dropping what it created.
    Ddl(Ddl),
    /// Refuse before execution, with this reason for the agent.
    Reject(String),
}

/// What a compensable DDL statement creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Object {
    Table { schema: Option<String>, name: String },
    Index { schema: Option<String>, name: String },
    View { schema: Option<String>, name: String, replace: bool },
    Schema { name: String },
    Column { schema: Option<String>, table: String, column: String },
}

#[derive(Debug, Clone)]
pub struct Ddl {
    pub object: Object,
    /// `IF NOT EXISTS`: a no-op when the object is there already. The proxy
    /// decides by looking (an existing object is never dropped by undo), so
    /// this is informational.
    #[cfg_attr(not(test), allow(dead_code))]
    pub if_not_exists: bool,
    /// `CREATE TABLE … AS` / `SELECT … INTO`: the new table is filled by the statement, with
    /// the results of these functions among others.
    pub fills: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Insert,
    Update,
    Delete,
}

/// A parsed INSERT/UPDATE/DELETE, ready to be rewritten once the table is known.
#[derive(Debug)]
pub struct Dml {
    pub kind: Kind,
    pub upsert: bool,
    pub schema: Option<String>,
    pub table: String,
    /// The statement reaches the table's inheritance children and partitions (no `ONLY`).
    pub inh: bool,
    /// How the statement refers to its target (alias or table name).
    refname: String,
    /// The statement without its RETURNING clause.
    body: String,
    returning: Option<Vec<Ret>>,
    /// Columns an UPDATE (or ON CONFLICT DO UPDATE) assigns.
    set_columns: Vec<String>,
    /// An UPDATE as parsed (without RETURNING): rewritten further when it changes key values.
    update: Option<Box<protobuf::UpdateStmt>>,
}

#[derive(Debug)]
enum Ret {
    Expr {
        sql: String,
        name: String,
    },
    /// `*` or `target.*`: every column of the target table.
    Star,
}

/// What the rewrite needs from the catalog.
#[derive(Debug, Clone)]
pub struct TableInfo {
    pub oid: u32,
    /// `schema.table`, quoted as needed.
    pub qualified: String,
    pub columns: Vec<String>,
    pub primary_key: Vec<String>,
    /// Why changes to this table cannot be compensated (triggers, cascading keys, …).
    pub problems: Vec<String>,
    /// A partitioned table (its rows live in its partitions, which have exactly its columns).
    pub partitioned: bool,
    /// Every relation below it (inheritance children, partitions, theirs): where a statement
    /// without `ONLY` really changes rows.
    pub descendants: Vec<Descendant>,
    /// The catalog's generation this was read at, when DDL is counted (see `db::Db`): the
    /// rewrite then fails at execution, changing nothing, if the catalog has moved on.
    pub catalog_generation: Option<i64>,
}

/// The WITH query that makes a statement rewritten from catalog answers of generation `g` fail
/// when the catalog has moved on (its message starts with CATALOG_CHANGED). A data-modifying
/// WITH query always runs, whether the statement reads it or not; it changes no row.
fn guard(g: i64) -> String {
    format!(
        "__planarian_guard AS (UPDATE {UNDO_SCHEMA}.catalog SET generation = generation WHERE CASE WHEN generation <> {g} THEN ('\"{CATALOG_CHANGED} to ' || generation || '\"')::regclass IS NULL ELSE false END)"
    )
}

/// How a statement rewritten from outdated catalog answers fails.
pub const CATALOG_CHANGED: &str = "planarian: catalog changed";

/// A relation a statement on its ancestor reaches.
#[derive(Debug, Clone)]
pub struct Descendant {
    pub oid: u32,
    /// `schema.table`, quoted as needed.
    pub qualified: String,
    pub primary_key: Vec<String>,
    /// Why changes reaching it cannot be compensated (its own triggers, rules, a foreign table…).
    pub problems: Vec<String>,
}

impl TableInfo {
    /// A plain table, for tests.
    #[cfg(test)]
    pub fn plain(qualified: &str, columns: &[&str], primary_key: &[&str]) -> TableInfo {
        TableInfo {
            qualified: qualified.into(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            primary_key: primary_key.iter().map(|c| c.to_string()).collect(),
            problems: vec![],
            partitioned: false,
            descendants: vec![],
            oid: 0,
            catalog_generation: None,
        }
    }
}

pub const UNDO_SCHEMA: &str = "planarian";

pub fn classify(sql: &str) -> Class {
    let parsed = match pg_query::parse(sql, pg_query::ParserOptions::DEFAULT) {
        Ok(p) => p,
        Err(e) => return Class::Reject(format!("the statement does not parse: {e}")),
    };
    let stmts = &parsed.protobuf.stmts;
    if stmts.len() != 1 {
        return Class::Reject(format!(
            "send one SQL statement per call (this call has {}): each call is recorded and undone as a unit",
            stmts.len()
        ));
    }
    if parsed.tables().iter().any(|t| t.starts_with(&format!("{UNDO_SCHEMA}."))) {
        return Class::Reject(format!(
            "the schema {UNDO_SCHEMA} holds the undo log of this sandbox and cannot be used"
        ));
    }
    let functions = called_functions(&parsed.protobuf);
    let Some(node) = stmts[0].stmt.as_ref().and_then(|n| n.node.as_ref()) else {
        return Class::Reject("empty statement".into());
    };
    classify_node(node, functions)
}

/// The statements of a text that may hold several (DBHub runs them in one transaction), each
/// with its own text.
pub fn split(sql: &str) -> Result<Vec<String>> {
    let parsed = pg_query::parse(sql, pg_query::ParserOptions::DEFAULT)
        .map_err(|e| Error::Sql(format!("the SQL does not parse: {e}")))?;
    let mut out = Vec::new();
    for raw in &parsed.protobuf.stmts {
        let start = raw.stmt_location.max(0) as usize;
        let end = if raw.stmt_len > 0 { start + raw.stmt_len as usize } else { sql.len() };
        let text =
            sql.get(start..end).ok_or_else(|| Error::Sql("the SQL does not split into statements".into()))?.trim();
        if !text.is_empty() {
            out.push(text.to_string());
        }
    }
    Ok(out)
}

/// Every function the statement calls, anywhere in it (pg_query's own list misses VALUES).
fn called_functions(tree: &protobuf::ParseResult) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(f) = m.get("FuncCall") {
                    let names: Vec<&str> = f["funcname"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|n| n["node"]["String"]["sval"].as_str()).collect())
                        .unwrap_or_default();
                    if !names.is_empty() {
                        out.push(names.join("."));
                    }
                }
                m.values().for_each(|x| walk(x, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&serde_json::to_value(tree).unwrap_or_default(), &mut out);
    out.sort();
    out.dedup();
    out
}

fn classify_node(node: &NodeEnum, functions: Vec<String>) -> Class {
    use NodeEnum as E;
    match node {
        E::SelectStmt(s) => {
            if let Some(into) = &s.into_clause {
                return table_as(into, s.with_clause.as_ref(), functions);
            }
            if modifying_ctes(s.with_clause.as_ref()).is_some() {
                return match statement(node, functions) {
                    Ok(st) => Class::Write(st),
                    Err(why) => Class::Reject(why.to_string()),
                };
            }
            Class::ReadOnly { functions }
        }
        E::ExplainStmt(e) => {
            let analyze = e.options.iter().any(|o| matches!(&o.node, Some(E::DefElem(d)) if d.defname == "analyze"));
            match e.query.as_ref().and_then(|q| q.node.as_ref()) {
                Some(E::SelectStmt(s)) if analyze && modifying_ctes(s.with_clause.as_ref()).is_some() => {
                    Class::Reject("EXPLAIN ANALYZE executes the statement: use EXPLAIN without ANALYZE for a change".into())
                }
                Some(inner @ E::SelectStmt(_)) if analyze => classify_node(inner, functions),
                Some(_) if analyze => {
                    Class::Reject("EXPLAIN ANALYZE executes the statement: use EXPLAIN without ANALYZE for a change".into())
                }
                _ => Class::ReadOnly { functions },
            }
        }
        E::VariableShowStmt(_) => Class::ReadOnly { functions },
        E::CreateTableAsStmt(c) => match (&c.into, c.query.as_ref().and_then(|q| q.node.as_ref())) {
            (Some(into), Some(E::SelectStmt(q))) if c.objtype == protobuf::ObjectType::ObjectTable as i32 => {
                let mut d = table_as(into, q.with_clause.as_ref(), functions);
                if let Class::Ddl(d) = &mut d {
                    d.if_not_exists = c.if_not_exists;
                }
                d
            }
            _ => Class::Reject("of CREATE … AS only CREATE TABLE … AS SELECT is compensable".into()),
        },
        E::InsertStmt(_) | E::UpdateStmt(_) | E::DeleteStmt(_) => match statement(node, functions) {
            Ok(st) => Class::Write(st),
            Err(why) => Class::Reject(why.to_string()),
        },
        E::CreateStmt(c) => match &c.relation {
            Some(r) if c.partbound.is_none() && c.inh_relations.is_empty() => Class::Ddl(Ddl {
                object: Object::Table { schema: opt(&r.schemaname), name: r.relname.clone() },
                if_not_exists: c.if_not_exists,
                fills: None,
            }),
            _ => Class::Reject("CREATE TABLE … PARTITION OF / INHERITS is not compensable: create a plain table".into()),
        },
        E::IndexStmt(i) => match (&i.relation, i.idxname.is_empty()) {
            (_, true) => Class::Reject("name the index (CREATE INDEX name ON …), so that it can be dropped again on rollback".into()),
            (Some(r), false) => Class::Ddl(Ddl {
                object: Object::Index { schema: opt(&r.schemaname), name: i.idxname.clone() },
                if_not_exists: i.if_not_exists,
                fills: None,
            }),
            (None, false) => Class::Reject("CREATE INDEX names no table".into()),
        },
        E::ViewStmt(v) => match &v.view {
            Some(r) => Class::Ddl(Ddl {
                object: Object::View { schema: opt(&r.schemaname), name: r.relname.clone(), replace: v.replace },
                if_not_exists: false,
                fills: None,
            }),
            None => Class::Reject("CREATE VIEW names no view".into()),
        },
        E::CreateSchemaStmt(c) if c.schema_elts.is_empty() && !c.schemaname.is_empty() => {
            Class::Ddl(Ddl { object: Object::Schema { name: c.schemaname.clone() }, if_not_exists: c.if_not_exists, fills: None })
        }
        E::AlterTableStmt(a) => add_column(a),
        E::TransactionStmt(_) => Class::Reject(
            "transaction control is not accepted: every call runs in its own transaction and is undone as a unit".into(),
        ),
        E::TruncateStmt(_) => Class::Reject("TRUNCATE cannot be undone: use DELETE FROM … WHERE …".into()),
        E::DropStmt(_) => Class::Reject("DROP cannot be undone here: objects are only removed by rolling back their creation".into()),
        E::DoStmt(_) => Class::Reject("DO blocks run arbitrary code that cannot be undone: send plain statements".into()),
        E::CallStmt(_) => Class::Reject("CALL runs a procedure whose effects cannot be undone: send plain statements".into()),
        E::CopyStmt(_) => Class::Reject("COPY cannot be undone: use INSERT".into()),
        E::MergeStmt(_) => Class::Reject("MERGE is not compensable yet: use INSERT … ON CONFLICT, UPDATE or DELETE".into()),
        E::VariableSetStmt(_) => Class::Reject("SET changes the session of a shared connection: not accepted".into()),
        other => Class::Reject(format!(
            "{} is not compensable: accepted are SELECT, INSERT (also ON CONFLICT), UPDATE and DELETE on tables with a primary key",
            statement_name(other)
        )),
    }
}

/// `CREATE TABLE t AS SELECT …` / `SELECT … INTO t`: a new table the statement fills; undone by
/// dropping it while it holds exactly what the statement put there.
fn table_as(into: &protobuf::IntoClause, with: Option<&protobuf::WithClause>, functions: Vec<String>) -> Class {
    if let Some(why) = modifying_ctes(with) {
        return Class::Reject(why);
    }
    let Some(r) = &into.rel else { return Class::Reject("CREATE TABLE … AS names no table".into()) };
    if r.relpersistence == "t" {
        return Class::Reject(
            "a temporary table lives in one connection of the server's pool and cannot be undone: create a plain table"
                .into(),
        );
    }
    Class::Ddl(Ddl {
        object: Object::Table { schema: opt(&r.schemaname), name: r.relname.clone() },
        if_not_exists: false,
        fills: (!into.skip_data).then_some(functions),
    })
}

fn opt(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

/// `ALTER TABLE t ADD COLUMN c …`, one column: the only ALTER whose inverse is safe.
fn add_column(a: &protobuf::AlterTableStmt) -> Class {
    let reject = || Class::Reject("of ALTER TABLE only ADD COLUMN (one column per statement) is compensable".into());
    let (Some(r), [cmd]) = (&a.relation, &a.cmds[..]) else { return reject() };
    if a.objtype != protobuf::ObjectType::ObjectTable as i32 {
        return reject();
    }
    let Some(NodeEnum::AlterTableCmd(c)) = &cmd.node else { return reject() };
    if c.subtype != protobuf::AlterTableType::AtAddColumn as i32 {
        return reject();
    }
    let Some(NodeEnum::ColumnDef(col)) = c.def.as_ref().and_then(|d| d.node.as_ref()) else { return reject() };
    Class::Ddl(Ddl {
        object: Object::Column { schema: opt(&r.schemaname), table: r.relname.clone(), column: col.colname.clone() },
        if_not_exists: c.missing_ok,
        fills: None,
    })
}

fn statement_name(n: &NodeEnum) -> String {
    let dbg = format!("{n:?}");
    let name = dbg.split(['(', ' ', '{']).next().unwrap_or("this statement");
    name.strip_suffix("Stmt").unwrap_or(name).to_string()
}

fn modifying_ctes(with: Option<&protobuf::WithClause>) -> Option<String> {
    let with = with?;
    for cte in &with.ctes {
        if let Some(NodeEnum::CommonTableExpr(c)) = &cte.node {
            if let Some(
                NodeEnum::InsertStmt(_) | NodeEnum::UpdateStmt(_) | NodeEnum::DeleteStmt(_) | NodeEnum::MergeStmt(_),
            ) = c.ctequery.as_ref().and_then(|q| q.node.as_ref())
            {
                return Some(format!(
                    "the data-modifying WITH query {} is not accepted: send each change as its own statement",
                    c.ctename
                ));
            }
        }
    }
    None
}

/// A parse tree holding one statement.
fn single(node: NodeEnum) -> protobuf::ParseResult {
    let mut tree = pg_query::parse("SELECT 1", pg_query::ParserOptions::DEFAULT).expect("SELECT 1 parses").protobuf;
    tree.stmts[0].stmt = Some(Box::new(Node { node: Some(node) }));
    tree
}

/// A statement that writes: one INSERT/UPDATE/DELETE, or one whose WITH clause holds
/// data-modifying queries (`WITH moved AS (DELETE … RETURNING …) INSERT INTO … SELECT … FROM
/// moved`), each of which is rewritten to record its undo rows, all in the one statement.
#[derive(Debug)]
pub struct Statement {
    recursive: bool,
    with: Vec<WithItem>,
    main: Main,
    pub functions: Vec<String>,
}

#[derive(Debug)]
enum WithItem {
    /// A query that only reads, as written (`name AS (…)`).
    Plain(String),
    /// A data-modifying query: its name as written (with column names) and the change.
    Dml { name: String, dml: Dml },
}

#[derive(Debug)]
enum Main {
    Dml(Dml),
    /// The SELECT that reads what the data-modifying queries returned, without its WITH.
    Select(String),
}

fn statement(node: &NodeEnum, functions: Vec<String>) -> Result<Statement> {
    let mut node = node.clone();
    let with = match &mut node {
        NodeEnum::InsertStmt(s) => s.with_clause.take(),
        NodeEnum::UpdateStmt(s) => s.with_clause.take(),
        NodeEnum::DeleteStmt(s) => s.with_clause.take(),
        NodeEnum::SelectStmt(s) => s.with_clause.take(),
        _ => return Err(Error::Sql("internal: not a statement that writes".into())),
    };
    let recursive = with.as_ref().is_some_and(|w| w.recursive);
    let mut items = Vec::new();
    for cte in with.map(|w| w.ctes).unwrap_or_default() {
        let Some(NodeEnum::CommonTableExpr(c)) = cte.node else {
            return Err(Error::Sql("unexpected WITH item".into()));
        };
        match c.ctequery.as_ref().and_then(|q| q.node.as_ref()) {
            Some(q @ (NodeEnum::InsertStmt(_) | NodeEnum::UpdateStmt(_) | NodeEnum::DeleteStmt(_))) => {
                let q = q.clone();
                if with_of(&q).is_some() {
                    return Err(Error::Sql(format!(
                        "the data-modifying WITH query {} has a WITH of its own: not accepted",
                        c.ctename
                    )));
                }
                let mut name = quote_ident(&c.ctename);
                let cols: Vec<String> = c
                    .aliascolnames
                    .iter()
                    .filter_map(|n| match &n.node {
                        Some(NodeEnum::String(s)) => Some(quote_ident(&s.sval)),
                        _ => None,
                    })
                    .collect();
                if !cols.is_empty() {
                    name += &format!(" ({})", cols.join(", "));
                }
                items.push(WithItem::Dml { name, dml: dml(q)? });
            }
            Some(NodeEnum::MergeStmt(_)) => {
                return Err(Error::Sql(format!("the WITH query {} is a MERGE: not compensable yet", c.ctename)))
            }
            _ => {
                // Deparsed on its own: `WITH [RECURSIVE] name AS (…) SELECT 1`, cut.
                let mut one = pg_query::parse("SELECT 1", pg_query::ParserOptions::DEFAULT)
                    .map_err(|e| Error::Sql(e.to_string()))?
                    .protobuf;
                let Some(NodeEnum::SelectStmt(sel)) = one.stmts[0].stmt.as_mut().and_then(|n| n.node.as_mut()) else {
                    return Err(Error::Sql("internal: SELECT 1 did not parse as SELECT".into()));
                };
                sel.with_clause = Some(protobuf::WithClause {
                    ctes: vec![Node { node: Some(NodeEnum::CommonTableExpr(c.clone())) }],
                    recursive,
                    location: 0,
                });
                let text = pg_query::deparse(&one, DeparseOptions::default())
                    .map_err(|e| Error::Sql(format!("cannot rewrite the statement: {e}")))?;
                let text = text.strip_prefix("WITH ").and_then(|t| t.strip_prefix("RECURSIVE ").or(Some(t)));
                let text = text
                    .and_then(|t| t.strip_suffix(" SELECT 1"))
                    .ok_or_else(|| Error::Sql("cannot rewrite the WITH clause".into()))?;
                items.push(WithItem::Plain(text.to_string()));
            }
        }
    }
    let main = match node {
        NodeEnum::SelectStmt(_) => Main::Select(
            pg_query::deparse(&single(node), DeparseOptions::default())
                .map_err(|e| Error::Sql(format!("cannot rewrite the statement: {e}")))?,
        ),
        n => Main::Dml(dml(n)?),
    };
    Ok(Statement { recursive, with: items, main, functions })
}

fn with_of(n: &NodeEnum) -> Option<&protobuf::WithClause> {
    match n {
        NodeEnum::InsertStmt(s) => s.with_clause.as_ref(),
        NodeEnum::UpdateStmt(s) => s.with_clause.as_ref(),
        NodeEnum::DeleteStmt(s) => s.with_clause.as_ref(),
        _ => None,
    }
}

impl Statement {
    /// Every change the statement makes, in the order it is written (the main one last).
    pub fn dmls(&self) -> Vec<&Dml> {
        let mut out: Vec<&Dml> = self
            .with
            .iter()
            .filter_map(|w| match w {
                WithItem::Dml { dml, .. } => Some(dml),
                WithItem::Plain(_) => None,
            })
            .collect();
        if let Main::Dml(d) = &self.main {
            out.push(d);
        }
        out
    }

    /// Whether it returns rows of its own (a statement without RETURNING returns none).
    pub fn has_returning(&self) -> bool {
        match &self.main {
            Main::Dml(d) => d.has_returning(),
            Main::Select(_) => true,
        }
    }

    /// The single statement that makes every change and records their undo rows at `position`;
    /// `tables` holds the catalog's answer for each of `dmls()`, in order.
    pub fn rewrite(&self, tables: &[TableInfo], position: u64, stmt: usize, count_rows: bool) -> Result<String> {
        let dmls = self.dmls();
        if dmls.len() != tables.len() {
            return Err(Error::Sql("internal: one table for each change".into()));
        }
        // Parts of one statement run on one snapshot in no set order: two that reach the same
        // relation could change one row twice, and only one change would count.
        let mut seen: Vec<(&str, &str)> = Vec::new();
        for (d, t) in dmls.iter().zip(tables) {
            for rel in std::iter::once(t.qualified.as_str()).chain(d.reached(t).iter().map(|x| x.qualified.as_str())) {
                if seen.iter().any(|(r, _)| *r == rel) {
                    return Err(Error::Sql(format!(
                        "two parts of the statement change {rel}, and PostgreSQL applies only one change to a row: send them as separate statements"
                    )));
                }
                seen.push((rel, &t.qualified));
            }
        }
        if self.with.is_empty() {
            if let Main::Dml(d) = &self.main {
                return d.rewrite(&tables[0], position, stmt, count_rows);
            }
        }
        let mut ctes = Vec::new();
        // (answers of different generations: the oldest, so that the statement fails and is
        // sent again with answers of the newest)
        if let Some(g) =
            tables.iter().map(|t| t.catalog_generation).collect::<Option<Vec<i64>>>().and_then(|g| g.into_iter().min())
        {
            ctes.push(guard(g));
        }
        let mut logs = Vec::new();
        let mut k = 0;
        for item in &self.with {
            match item {
                WithItem::Plain(text) => ctes.push(text.clone()),
                WithItem::Dml { name, dml } => {
                    let raw = format!("__planarian_c{k}");
                    let p = dml.parts(&tables[k], position, stmt, (k as u64) << 32, &raw)?;
                    ctes.extend(p.pre);
                    ctes.push(format!("{raw} AS ({})", p.change));
                    if dml.has_returning() {
                        ctes.push(format!("{name} AS (SELECT {} FROM {raw} m)", p.outer.join(", ")));
                    }
                    logs.push(format!("__planarian_log{k} AS ({})", p.log));
                    k += 1;
                }
            }
        }
        let recursive = if self.recursive { "RECURSIVE " } else { "" };
        let select = match &self.main {
            Main::Select(text) => text.clone(),
            Main::Dml(d) => {
                let p = d.parts(&tables[k], position, stmt, (k as u64) << 32, "__planarian_m")?;
                ctes.extend(p.pre);
                ctes.push(format!("__planarian_m AS ({})", p.change));
                logs.push(format!("__planarian_log AS ({})", p.log));
                d.select(&p.outer, count_rows)
            }
        };
        ctes.extend(logs);
        Ok(format!("WITH {recursive}{} {select}", ctes.join(", ")))
    }
}

/// One change of a statement, rewritten: the change with its RETURNING extended, the insert
/// of its undo rows, and the columns the original RETURNING named.
struct Parts {
    /// `name_pre AS (…)`: the rows an UPDATE of key values will change, read first.
    pre: Option<String>,
    change: String,
    log: String,
    outer: Vec<String>,
}

fn dml(node: NodeEnum) -> Result<Dml> {
    let mut tree = single(node);
    let stmt = tree.stmts[0]
        .stmt
        .as_mut()
        .and_then(|n| n.node.as_mut())
        .ok_or_else(|| Error::Sql("empty statement".into()))?;
    let (kind, relation, with, returning, upsert, set_columns, other_relations) = match stmt {
        NodeEnum::InsertStmt(s) => {
            let (upsert, set) = match s.on_conflict_clause.as_ref() {
                Some(oc) if oc.action == protobuf::OnConflictAction::OnconflictUpdate as i32 => {
                    (true, res_names(&oc.target_list))
                }
                Some(_) => (true, vec![]),
                None => (false, vec![]),
            };
            (Kind::Insert, s.relation.clone(), s.with_clause.clone(), s.returning_clause.take(), upsert, set, false)
        }
        NodeEnum::UpdateStmt(s) => (
            Kind::Update,
            s.relation.clone(),
            s.with_clause.clone(),
            s.returning_clause.take(),
            false,
            res_names(&s.target_list),
            !s.from_clause.is_empty(),
        ),
        NodeEnum::DeleteStmt(s) => (
            Kind::Delete,
            s.relation.clone(),
            s.with_clause.clone(),
            s.returning_clause.take(),
            false,
            vec![],
            !s.using_clause.is_empty(),
        ),
        _ => unreachable!("dml() is called for INSERT/UPDATE/DELETE"),
    };
    if with.is_some() {
        return Err(Error::Sql("internal: a WITH clause reached dml()".into()));
    }
    let relation = relation.ok_or_else(|| Error::Sql("the statement names no table".into()))?;
    let refname = relation.alias.as_ref().map(|a| a.aliasname.clone()).unwrap_or_else(|| relation.relname.clone());
    let returning = match returning {
        None => None,
        Some(r) if !r.options.is_empty() => {
            return Err(Error::Sql(
                "RETURNING WITH (OLD/NEW …) is not accepted: name the columns in plain RETURNING".into(),
            ));
        }
        Some(r) => Some(r.exprs.iter().map(|n| ret_item(n, &refname, other_relations)).collect::<Result<Vec<_>, _>>()?),
    };
    let body = pg_query::deparse(&tree, DeparseOptions::default())
        .map_err(|e| Error::Sql(format!("cannot rewrite the statement: {e}")))?;
    let update = match tree.stmts[0].stmt.as_ref().and_then(|n| n.node.as_ref()) {
        Some(NodeEnum::UpdateStmt(u)) => Some(u.clone()),
        _ => None,
    };
    Ok(Dml {
        update,
        kind,
        upsert,
        schema: (!relation.schemaname.is_empty()).then(|| relation.schemaname.clone()),
        table: relation.relname.clone(),
        inh: relation.inh,
        refname,
        body,
        returning,
        set_columns,
    })
}

fn res_names(targets: &[Node]) -> Vec<String> {
    targets
        .iter()
        .filter_map(|t| match &t.node {
            Some(NodeEnum::ResTarget(r)) => Some(r.name.clone()),
            _ => None,
        })
        .collect()
}

fn ret_item(n: &Node, refname: &str, other_relations: bool) -> Result<Ret> {
    let Some(NodeEnum::ResTarget(r)) = &n.node else { return Err(Error::Sql("unexpected RETURNING item".into())) };
    let val = r.val.as_ref().and_then(|v| v.node.as_ref()).ok_or_else(|| Error::Sql("empty RETURNING item".into()))?;
    if let NodeEnum::ColumnRef(c) = val {
        if matches!(c.fields.last().and_then(|f| f.node.as_ref()), Some(NodeEnum::AStar(_))) {
            let qualifier = match c.fields.first().and_then(|f| f.node.as_ref()) {
                Some(NodeEnum::String(s)) if c.fields.len() == 2 => Some(s.sval.clone()),
                _ => None,
            };
            return match qualifier {
                Some(q) if q == refname => Ok(Ret::Star),
                None if !other_relations => Ok(Ret::Star),
                _ => Err(Error::Sql("RETURNING * over several tables is not accepted: name the columns".into())),
            };
        }
    }
    let name = if r.name.is_empty() { figure_name(val).unwrap_or_else(|| "?column?".into()) } else { r.name.clone() };
    Ok(Ret::Expr { sql: deparse_expr(val)?, name })
}

/// The column name PostgreSQL gives an unnamed output expression (its FigureColname rules, for
/// the common cases).
fn figure_name(n: &NodeEnum) -> Option<String> {
    use NodeEnum as E;
    let last_string = |nodes: &[Node]| {
        nodes.iter().rev().find_map(|f| match &f.node {
            Some(E::String(s)) => Some(s.sval.clone()),
            _ => None,
        })
    };
    match n {
        E::ColumnRef(c) => last_string(&c.fields),
        E::FuncCall(f) => last_string(&f.funcname),
        E::TypeCast(t) => t
            .arg
            .as_ref()
            .and_then(|a| a.node.as_ref())
            .and_then(figure_name)
            .or_else(|| t.type_name.as_ref().and_then(|tn| last_string(&tn.names))),
        E::AIndirection(i) => {
            last_string(&i.indirection).or_else(|| i.arg.as_ref().and_then(|a| a.node.as_ref()).and_then(figure_name))
        }
        E::CaseExpr(_) => Some("case".into()),
        E::AArrayExpr(_) => Some("array".into()),
        E::CoalesceExpr(_) => Some("coalesce".into()),
        E::NullIfExpr(_) => Some("nullif".into()),
        E::RowExpr(_) => Some("row".into()),
        E::MinMaxExpr(m) => {
            Some(if m.op == protobuf::MinMaxOp::IsGreatest as i32 { "greatest" } else { "least" }.into())
        }
        E::SubLink(s) if s.sub_link_type == protobuf::SubLinkType::ExistsSublink as i32 => Some("exists".into()),
        E::SubLink(s) if s.sub_link_type == protobuf::SubLinkType::ArraySublink as i32 => Some("array".into()),
        _ => None,
    }
}

fn deparse_expr(val: &NodeEnum) -> Result<String> {
    let mut sel =
        pg_query::parse("SELECT 1", pg_query::ParserOptions::DEFAULT).map_err(|e| Error::Sql(e.to_string()))?.protobuf;
    let Some(NodeEnum::SelectStmt(s)) = sel.stmts[0].stmt.as_mut().and_then(|n| n.node.as_mut()) else {
        return Err(Error::Sql("internal: SELECT 1 did not parse as SELECT".into()));
    };
    let target = protobuf::ResTarget { val: Some(Box::new(Node { node: Some(val.clone()) })), ..Default::default() };
    s.target_list = vec![Node { node: Some(NodeEnum::ResTarget(Box::new(target))) }];
    let text = pg_query::deparse(&sel, DeparseOptions::default())
        .map_err(|e| Error::Sql(format!("cannot rewrite RETURNING: {e}")))?;
    Ok(text.strip_prefix("SELECT ").unwrap_or(&text).to_string())
}

pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

impl Dml {
    pub fn has_returning(&self) -> bool {
        self.returning.is_some()
    }

    /// The table as the statement names it, for the catalog look-up.
    pub fn table_name(&self) -> String {
        match &self.schema {
            Some(s) => format!("{}.{}", quote_ident(s), quote_ident(&self.table)),
            None => quote_ident(&self.table),
        }
    }

    /// The single statement that makes the change and records its undo rows at `position`.
    /// `stmt` numbers the statement within its call; with `count_rows`, a statement without
    /// RETURNING yields one empty row per changed row (for servers that report a row count).
    pub fn rewrite(&self, t: &TableInfo, position: u64, stmt: usize, count_rows: bool) -> Result<String> {
        let p = self.parts(t, position, stmt, 0, "__planarian_m")?;
        let pre = t.catalog_generation.map(|g| guard(g) + ", ").unwrap_or_default()
            + &p.pre.map(|p| p + ", ").unwrap_or_default();
        Ok(format!(
            "WITH {pre}__planarian_m AS ({}), __planarian_log AS ({}) {}",
            p.change,
            p.log,
            self.select(&p.outer, count_rows)
        ))
    }

    /// What the rewritten statement returns, read from the change `__planarian_m`: what the
    /// original RETURNING named, or one empty row per changed row (`count_rows`), or nothing.
    fn select(&self, outer: &[String], count_rows: bool) -> String {
        if self.returning.is_some() {
            format!("SELECT {} FROM __planarian_m m", outer.join(", "))
        } else if count_rows {
            "SELECT FROM __planarian_m m".to_string()
        } else {
            "SELECT FROM __planarian_m m WHERE false".to_string()
        }
    }

    /// The change as the WITH query `name`, and the insert of its undo rows (numbered from
    /// `seq_base`).
    fn parts(&self, t: &TableInfo, position: u64, stmt: usize, seq_base: u64, name: &str) -> Result<Parts> {
        let reached = self.reached(t);
        let mut problems = t.problems.clone();
        for d in reached {
            problems.extend(
                d.problems
                    .iter()
                    .map(|p| format!("{p} (a {} of it)", if t.partitioned { "partition" } else { "child table" })),
            );
            // An inheritance child's rows are found by the parent's key only if it has that key too
            // (PostgreSQL does not inherit primary keys); partitions share the parent's.
            if !t.partitioned && d.primary_key != t.primary_key {
                problems.push(format!(
                    "its child table {} has no primary key ({}) of its own, so its rows cannot be told apart: add one, or write to ONLY {}",
                    d.qualified,
                    t.primary_key.join(", "),
                    t.qualified
                ));
            }
        }
        if !problems.is_empty() {
            return Err(Error::Sql(format!("changes to {} cannot be undone: {}", t.qualified, problems.join("; "))));
        }
        if t.primary_key.is_empty() {
            return Err(Error::Sql(format!(
                "{} has no primary key, so its rows cannot be told apart to undo a change: add one",
                t.qualified
            )));
        }
        let key_change = self.set_columns.iter().find(|c| t.primary_key.contains(c));
        if let (Some(c), true) = (key_change, self.upsert) {
            return Err(Error::Sql(format!(
                "ON CONFLICT DO UPDATE changes the primary key column {c} of {}: not accepted",
                t.qualified
            )));
        }
        // An UPDATE of key values: the rows as they were are read, locked, by a WITH query the
        // change joins (the new key cannot find them).
        let pre = match key_change {
            Some(_) => Some(self.keyed_update(t, reached, &format!("{name}_pre"))?),
            None => None,
        };
        let r = quote_ident(&self.refname);
        let mut rets = Vec::new();
        let mut outer = Vec::new();
        for item in self.returning.iter().flatten() {
            match item {
                Ret::Star => {
                    for c in &t.columns {
                        outer.push(format!("m.__planarian_r{} AS {}", rets.len(), quote_ident(c)));
                        rets.push(format!("{r}.{} AS __planarian_r{}", quote_ident(c), rets.len()));
                    }
                }
                Ret::Expr { sql, name } => {
                    outer.push(format!("m.__planarian_r{} AS {}", rets.len(), quote_ident(name)));
                    rets.push(format!("{sql} AS __planarian_r{}", rets.len()));
                }
            }
        }
        rets.push(format!("to_jsonb({r}.*) AS __planarian_img"));
        for (i, k) in t.primary_key.iter().enumerate() {
            rets.push(format!("{r}.{} AS __planarian_k{i}", quote_ident(k)));
        }
        // The row as it was, read from one relation by key. ONLY: a child's row with the same key
        // is another row (a partitioned table itself holds none, so it is read whole).
        let lookup = |only: &str, rel: &str| {
            let cond: Vec<String> = t
                .primary_key
                .iter()
                .enumerate()
                .map(|(i, k)| format!("o.{} = m.__planarian_k{i}", quote_ident(k)))
                .collect();
            format!("(SELECT to_jsonb(o.*) FROM {only}{rel} o WHERE {})", cond.join(" AND "))
        };
        let own = lookup(if t.partitioned { "" } else { "ONLY " }, &t.qualified);
        // The relation each row really lives in: the named table, or the descendant PostgreSQL
        // routed it to.
        let rel = if reached.is_empty() {
            quote_literal(&t.qualified)
        } else {
            rets.push(format!("{r}.tableoid AS __planarian_rel"));
            let mut case = format!("CASE m.__planarian_rel WHEN {} THEN {}", t.oid, quote_literal(&t.qualified));
            for d in reached {
                case += &format!(" WHEN {} THEN {}", d.oid, quote_literal(&d.qualified));
            }
            // A child or partition created since the look-up: the statement fails, changing
            // nothing (the message is an unknown relation's name).
            case + &format!(
                " ELSE ('\"{CATALOG_CHANGED}: new relation ' || m.__planarian_rel || '\"')::regclass::text END"
            )
        };
        let (rel, before, after) = match &pre {
            Some((_, _, pre_name)) => {
                rets.push(format!("{pre_name}.__planarian_b AS __planarian_before"));
                rets.push(format!("{pre_name}.__planarian_o AS __planarian_orel"));
                // Where the row lived before (for a partitioned table, the partition it may have
                // left: undo goes through the table, which routes it back).
                let rel = if reached.is_empty() {
                    rel
                } else {
                    rel.replacen("CASE m.__planarian_rel", "CASE m.__planarian_orel", 1)
                };
                let after = if !reached.is_empty() && !t.partitioned {
                    "m.__planarian_before || m.__planarian_img"
                } else {
                    "m.__planarian_img"
                };
                (rel, "m.__planarian_before".to_string(), after.to_string())
            }
            None => {
                let (b, a) = self.images(t, reached, own, &lookup);
                (rel, b, a)
            }
        };
        let body = match &pre {
            Some((_, body, _)) => body.clone(),
            None => self.body.clone(),
        };
        let seq = if seq_base == 0 {
            "row_number() OVER ()".to_string()
        } else {
            format!("{seq_base} + row_number() OVER ()")
        };
        Ok(Parts {
            pre: pre.map(|(p, _, n)| format!("{n} AS ({p})")),
            change: format!("{body} RETURNING {}", rets.join(", ")),
            log: format!(
                "INSERT INTO {UNDO_SCHEMA}.undo (position, stmt, seq, tbl, rel, before, after) SELECT {position}, {stmt}, {seq}, {}, {rel}, {before}, {after} FROM {name} m",
                quote_literal(&t.qualified)
            ),
            outer,
        })
    }

    /// The before- and after-image of each changed row, for a change that keeps its key.
    fn images(
        &self,
        t: &TableInfo,
        reached: &[Descendant],
        own: String,
        lookup: &dyn Fn(&str, &str) -> String,
    ) -> (String, String) {
        match (self.kind, self.upsert) {
            (Kind::Insert, false) => ("NULL::jsonb".to_string(), "m.__planarian_img".to_string()),
            // An inheritance child has columns of its own, which the statement on its parent
            // neither returns nor changes: its whole row is read from it, before the change.
            (Kind::Delete | Kind::Update, _) if !reached.is_empty() && !t.partitioned => {
                let mut case = format!(
                    "CASE m.__planarian_rel WHEN {} THEN {}",
                    t.oid,
                    if self.kind == Kind::Delete { "m.__planarian_img".to_string() } else { own }
                );
                for d in reached {
                    case += &format!(" WHEN {} THEN {}", d.oid, lookup("ONLY ", &d.qualified));
                }
                let before = case + " END";
                let after = if self.kind == Kind::Delete {
                    "NULL::jsonb".to_string()
                } else {
                    format!("({before}) || m.__planarian_img")
                };
                (before, after)
            }
            (Kind::Delete, _) => ("m.__planarian_img".to_string(), "NULL::jsonb".to_string()),
            _ => (own, "m.__planarian_img".to_string()),
        }
    }

    /// An UPDATE that changes key values, as a WITH query `pre_name` reading (and locking) the
    /// rows it will change — whole, with the relation each lives in — and the UPDATE joining it.
    fn keyed_update(&self, t: &TableInfo, reached: &[Descendant], pre_name: &str) -> Result<(String, String, String)> {
        let mut u = self.update.clone().ok_or_else(|| Error::Sql("internal: not an UPDATE".into()))?;
        let r = quote_ident(&self.refname);
        let whole = if !reached.is_empty() && !t.partitioned {
            let mut case = format!("CASE {r}.tableoid WHEN {} THEN to_jsonb({r}.*)", t.oid);
            for d in reached {
                case += &format!(
                    " WHEN {} THEN (SELECT to_jsonb(o.*) FROM ONLY {} o WHERE o.ctid = {r}.ctid)",
                    d.oid, d.qualified
                );
            }
            case + " END"
        } else {
            format!("to_jsonb({r}.*)")
        };
        let bad = |e: pg_query::Error| Error::Sql(format!("cannot rewrite the statement: {e}"));
        let mut one = pg_query::parse("SELECT 1", pg_query::ParserOptions::DEFAULT).map_err(bad)?.protobuf;
        let Some(NodeEnum::SelectStmt(sel)) = one.stmts[0].stmt.as_mut().and_then(|n| n.node.as_mut()) else {
            return Err(Error::Sql("internal: SELECT 1 did not parse as SELECT".into()));
        };
        let relation = u.relation.clone().ok_or_else(|| Error::Sql("the statement names no table".into()))?;
        sel.from_clause = std::iter::once(Node { node: Some(NodeEnum::RangeVar(relation)) })
            .chain(u.from_clause.iter().cloned())
            .collect();
        sel.where_clause = u.where_clause.clone();
        let text = pg_query::deparse(&one, DeparseOptions::default()).map_err(bad)?;
        let rest = text.strip_prefix("SELECT 1").ok_or_else(|| Error::Sql("cannot rewrite the statement".into()))?;
        let pre = format!(
            "SELECT {r}.tableoid AS __planarian_o, {r}.ctid AS __planarian_t, {whole} AS __planarian_b{rest} FOR UPDATE OF {r}"
        );
        let cond = match u.where_clause.as_ref().and_then(|w| w.node.as_ref()) {
            Some(w) => format!("({}) AND ", deparse_expr(w)?),
            None => String::new(),
        };
        let join = pg_query::parse(
            &format!("SELECT 1 FROM {pre_name} WHERE {cond}{r}.tableoid = {pre_name}.__planarian_o AND {r}.ctid = {pre_name}.__planarian_t"),
            pg_query::ParserOptions::DEFAULT,
        )
        .map_err(bad)?
        .protobuf;
        let Some(NodeEnum::SelectStmt(j)) = join.stmts[0].stmt.as_ref().and_then(|n| n.node.as_ref()) else {
            return Err(Error::Sql("internal: the join did not parse as SELECT".into()));
        };
        u.where_clause = j.where_clause.clone();
        u.from_clause.push(j.from_clause[0].clone());
        let body = pg_query::deparse(&single(NodeEnum::UpdateStmt(u)), DeparseOptions::default()).map_err(bad)?;
        Ok((pre, body, pre_name.to_string()))
    }

    /// The descendants whose rows the statement can change: none with `ONLY`, none for a plain
    /// INSERT into an inheritance parent (its rows stay there), the partitions a partitioned
    /// table routes rows to.
    fn reached<'a>(&self, t: &'a TableInfo) -> &'a [Descendant] {
        if !self.inh || (self.kind == Kind::Insert && !t.partitioned) {
            &[]
        } else {
            &t.descendants
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> TableInfo {
        TableInfo::plain("public.t", &["id", "x"], &["id"])
    }

    fn write(sql: &str) -> Statement {
        match classify(sql) {
            Class::Write(d) => d,
            other => panic!("{sql}: {other:?}"),
        }
    }

    fn rejected(sql: &str) -> String {
        match classify(sql) {
            Class::Reject(why) => why,
            other => panic!("{sql} was not rejected: {other:?}"),
        }
    }

    #[test]
    fn every_called_function_is_found() {
        let Class::Write(d) = classify("INSERT INTO t VALUES (nextval('s'), lower(x)) RETURNING f(id)") else {
            panic!()
        };
        assert_eq!(d.functions, ["f", "lower", "nextval"]);
        let Class::ReadOnly { functions } = classify("SELECT pg_catalog.sneaky() FROM t WHERE g(1)") else { panic!() };
        assert_eq!(functions, ["g", "pg_catalog.sneaky"]);
    }

    #[test]
    fn split_keeps_each_statement_text() {
        assert_eq!(
            split("INSERT INTO t VALUES (1, ';'); SELECT 2 ;\n DELETE FROM t").unwrap(),
            ["INSERT INTO t VALUES (1, ';')", "SELECT 2", "DELETE FROM t"]
        );
    }

    #[test]
    fn ddl_with_a_known_inverse() {
        let ddl = |q: &str| match classify(q) {
            Class::Ddl(d) => (d.object, d.if_not_exists),
            other => panic!("{q}: {other:?}"),
        };
        assert_eq!(
            ddl("CREATE TABLE IF NOT EXISTS s.t (id int PRIMARY KEY)"),
            (Object::Table { schema: Some("s".into()), name: "t".into() }, true)
        );
        assert_eq!(ddl("CREATE INDEX i ON t (x)"), (Object::Index { schema: None, name: "i".into() }, false));
        assert_eq!(
            ddl("CREATE OR REPLACE VIEW v AS SELECT 1"),
            (Object::View { schema: None, name: "v".into(), replace: true }, false)
        );
        assert_eq!(
            ddl("CREATE TABLE s.t2 AS SELECT * FROM t"),
            (Object::Table { schema: Some("s".into()), name: "t2".into() }, false)
        );
        assert_eq!(
            ddl("SELECT id, upper(x) INTO t3 FROM t"),
            (Object::Table { schema: None, name: "t3".into() }, false)
        );
        let Class::Ddl(d) = classify("CREATE TABLE IF NOT EXISTS t4 AS SELECT f(x) FROM t") else { panic!() };
        assert_eq!((d.if_not_exists, d.fills), (true, Some(vec!["f".to_string()])));
        let Class::Ddl(d) = classify("CREATE TABLE t5 AS SELECT * FROM t WITH NO DATA") else { panic!() };
        assert_eq!(d.fills, None);
        assert_eq!(ddl("CREATE SCHEMA app"), (Object::Schema { name: "app".into() }, false));
        assert_eq!(
            ddl("ALTER TABLE t ADD COLUMN IF NOT EXISTS c text DEFAULT 'x'"),
            (Object::Column { schema: None, table: "t".into(), column: "c".into() }, true)
        );
    }

    #[test]
    fn reads_pass() {
        for q in [
            "SELECT * FROM t",
            "select count(*) from t where x = 'a'",
            "EXPLAIN SELECT 1",
            "SHOW search_path",
            "WITH a AS (SELECT 1) SELECT * FROM a",
        ] {
            assert!(matches!(classify(q), Class::ReadOnly { .. }), "{q}");
        }
    }

    #[test]
    fn uncompensable_statements_are_rejected_with_a_reason() {
        for (q, want) in [
            ("TRUNCATE t", "TRUNCATE"),
            ("DROP TABLE t CASCADE", "DROP"),
            ("DO $$ BEGIN END $$", "DO blocks"),
            ("CALL p()", "CALL"),
            ("COPY t FROM STDIN", "COPY"),
            ("BEGIN", "transaction control"),
            ("COMMIT", "transaction control"),
            ("INSERT INTO t VALUES (1); INSERT INTO t VALUES (2)", "one SQL statement per call"),
            ("WITH d AS (MERGE INTO t USING u ON t.id = u.id WHEN MATCHED THEN DELETE) SELECT 1", "MERGE"),
            ("EXPLAIN ANALYZE WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d", "EXPLAIN ANALYZE"),
            ("SELECT * INTO TEMP t2 FROM t", "temporary table"),
            ("CREATE MATERIALIZED VIEW m AS SELECT 1", "CREATE TABLE … AS SELECT"),
            ("EXPLAIN ANALYZE DELETE FROM t", "EXPLAIN ANALYZE"),
            ("DELETE FROM planarian.undo", "undo log"),
            ("ALTER TABLE t DROP COLUMN x", "only ADD COLUMN"),
            ("ALTER TABLE t ADD COLUMN a int, ADD COLUMN b int", "only ADD COLUMN"),
            ("CREATE INDEX ON t (x)", "name the index"),
            ("CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'", "not compensable"),
            ("SELEC 1", "does not parse"),
        ] {
            let why = rejected(q);
            assert!(why.contains(want), "{q}: {why}");
        }
    }

    #[test]
    fn rewrite_keeps_the_statement_and_its_returning() {
        let d = write("UPDATE ONLY t AS a SET x = 'b' WHERE a.id = 1 RETURNING a.x, id * 2, *");
        assert_eq!(d.dmls()[0].kind, Kind::Update);
        assert_eq!(d.dmls()[0].table_name(), "\"t\"");
        let sql = d.rewrite(std::slice::from_ref(&table()), 7, 0, false).unwrap();
        assert!(sql.starts_with("WITH __planarian_m AS (UPDATE ONLY t a SET x = 'b' WHERE a.id = 1 RETURNING a.x AS __planarian_r0, id * 2 AS __planarian_r1, \"a\".\"id\" AS __planarian_r2"), "{sql}");
        assert!(sql.contains("SELECT 7, 0, row_number() OVER (), 'public.t', 'public.t', (SELECT to_jsonb(o.*) FROM ONLY public.t o WHERE o.\"id\" = m.__planarian_k0)"), "{sql}");
        assert!(sql.ends_with("SELECT m.__planarian_r0 AS \"x\", m.__planarian_r1 AS \"?column?\", m.__planarian_r2 AS \"id\", m.__planarian_r3 AS \"x\" FROM __planarian_m m"), "{sql}");
        assert!(
            matches!(pg_query::parse(&sql, pg_query::ParserOptions::DEFAULT), Ok(p) if p.protobuf.stmts.len() == 1)
        );
    }

    #[test]
    fn rewrite_without_returning_returns_no_rows() {
        let sql = write("DELETE FROM t WHERE id > 3").rewrite(std::slice::from_ref(&table()), 1, 0, false).unwrap();
        assert!(sql.ends_with("SELECT FROM __planarian_m m WHERE false"), "{sql}");
        assert!(
            sql.contains("SELECT 1, 0, row_number() OVER (), 'public.t', 'public.t', m.__planarian_img, NULL::jsonb"),
            "{sql}"
        );
        let ins = write("INSERT INTO t (id, x) VALUES (5, 'e')")
            .rewrite(std::slice::from_ref(&table()), 2, 0, false)
            .unwrap();
        assert!(ins.contains("'public.t', NULL::jsonb, m.__planarian_img"), "{ins}");
        let up = write("INSERT INTO t VALUES (5, 'e') ON CONFLICT (id) DO UPDATE SET x = excluded.x")
            .rewrite(std::slice::from_ref(&table()), 3, 0, false)
            .unwrap();
        assert!(up.contains("(SELECT to_jsonb(o.*) FROM ONLY public.t o"), "{up}");
    }

    #[test]
    fn data_modifying_with_queries_record_each_change_in_the_one_statement() {
        let u = TableInfo::plain("public.u", &["id", "x"], &["id"]);
        let st = write("WITH moved AS (DELETE FROM t WHERE id < 3 RETURNING *), s AS (SELECT count(*) AS n FROM moved) INSERT INTO u SELECT id, x FROM moved RETURNING id");
        let sql = st.rewrite(&[table(), u.clone()], 4, 1, false).unwrap();
        eprintln!("{sql}");
        assert!(sql.starts_with("WITH __planarian_c0 AS (DELETE FROM t WHERE id < 3 RETURNING \"t\".\"id\" AS __planarian_r0, \"t\".\"x\" AS __planarian_r1, to_jsonb(\"t\".*) AS __planarian_img, \"t\".\"id\" AS __planarian_k0), \"moved\" AS (SELECT m.__planarian_r0 AS \"id\", m.__planarian_r1 AS \"x\" FROM __planarian_c0 m), s AS (SELECT count(*) AS n FROM moved), __planarian_m AS (INSERT INTO u SELECT id, x FROM moved RETURNING id AS __planarian_r0"), "{sql}");
        assert!(sql.contains("__planarian_log0 AS (INSERT INTO planarian.undo (position, stmt, seq, tbl, rel, before, after) SELECT 4, 1, row_number() OVER (), 'public.t'"), "{sql}");
        assert!(sql.contains("__planarian_log AS (INSERT INTO planarian.undo (position, stmt, seq, tbl, rel, before, after) SELECT 4, 1, 4294967296 + row_number() OVER (), 'public.u'"), "{sql}");
        assert!(sql.ends_with("SELECT m.__planarian_r0 AS \"id\" FROM __planarian_m m"), "{sql}");
        assert!(
            matches!(pg_query::parse(&sql, pg_query::ParserOptions::DEFAULT), Ok(p) if p.protobuf.stmts.len() == 1)
        );
        // Column names of the WITH query are kept; a SELECT can be the statement that reads it.
        let sql = write("WITH gone (k) AS (DELETE FROM t RETURNING id) SELECT count(*) FROM gone")
            .rewrite(&[table()], 5, 0, false)
            .unwrap();
        assert!(
            sql.contains("\"gone\" (\"k\") AS (SELECT m.__planarian_r0 AS \"id\" FROM __planarian_c0 m)")
                && sql.ends_with("SELECT count(*) FROM gone"),
            "{sql}"
        );
        // Two parts changing one table: PostgreSQL would apply only one change to a row.
        let why = write("WITH a AS (UPDATE t SET x = 'a' WHERE id = 1) DELETE FROM t WHERE id = 2")
            .rewrite(&[table(), table()], 1, 0, false)
            .unwrap_err()
            .to_string();
        assert!(why.contains("two parts of the statement change public.t"), "{why}");
    }

    #[test]
    fn an_update_of_key_values_reads_the_rows_first_and_joins_them() {
        let sql = write("UPDATE t AS a SET id = a.id + 10, x = u.x FROM u WHERE a.x = u.x AND a.id < 5 RETURNING a.id")
            .rewrite(&[table()], 3, 0, false)
            .unwrap();
        assert!(sql.starts_with("WITH __planarian_m_pre AS (SELECT \"a\".tableoid AS __planarian_o, \"a\".ctid AS __planarian_t, to_jsonb(\"a\".*) AS __planarian_b FROM t a, u WHERE a.x = u.x AND a.id < 5 FOR UPDATE OF \"a\"), __planarian_m AS (UPDATE t a SET id = a.id + 10, x = u.x FROM u, __planarian_m_pre WHERE a.x = u.x AND a.id < 5 AND a.tableoid = __planarian_m_pre.__planarian_o AND a.ctid = __planarian_m_pre.__planarian_t RETURNING"), "{sql}");
        assert!(
            sql.contains(
                "SELECT 3, 0, row_number() OVER (), 'public.t', 'public.t', m.__planarian_before, m.__planarian_img"
            ),
            "{sql}"
        );
        // A child's own columns come from the child; the row's relation from before the change.
        let t = with_child(false, &["id"]);
        let sql = write("UPDATE t SET id = -id").rewrite(&[t], 3, 0, false).unwrap();
        assert!(sql.contains("CASE \"t\".tableoid WHEN 100 THEN to_jsonb(\"t\".*) WHEN 101 THEN (SELECT to_jsonb(o.*) FROM ONLY public.c o WHERE o.ctid = \"t\".ctid) END AS __planarian_b"), "{sql}");
        assert!(sql.contains("CASE m.__planarian_orel WHEN 100 THEN 'public.t' WHEN 101 THEN 'public.c' ELSE ('\"planarian: catalog changed: new relation ' || m.__planarian_rel || '\"')::regclass::text END, m.__planarian_before, m.__planarian_before || m.__planarian_img"), "{sql}");
        // In a data-modifying WITH query, each part has its own.
        let sql = write("WITH a AS (UPDATE t SET id = id + 1) UPDATE u SET id = id - 1")
            .rewrite(&[table(), TableInfo::plain("public.u", &["id"], &["id"])], 3, 0, false)
            .unwrap();
        assert!(
            sql.starts_with("WITH __planarian_c0_pre AS (")
                && sql.contains("), __planarian_c0 AS (UPDATE t SET id = id + 1 FROM __planarian_c0_pre WHERE")
                && sql.contains("__planarian_m_pre AS ("),
            "{sql}"
        );
    }

    fn with_child(partitioned: bool, child_key: &[&str]) -> TableInfo {
        let mut t = table();
        t.oid = 100;
        t.partitioned = partitioned;
        t.descendants.push(Descendant {
            oid: 101,
            qualified: "public.c".into(),
            primary_key: child_key.iter().map(|k| k.to_string()).collect(),
            problems: vec![],
        });
        t
    }

    #[test]
    fn rows_of_inheritance_children_are_recorded_whole_and_where_they_live() {
        let t = with_child(false, &["id"]);
        let del = write("DELETE FROM t WHERE id > 3").rewrite(std::slice::from_ref(&t), 1, 0, false).unwrap();
        assert!(del.contains("\"t\".tableoid AS __planarian_rel"), "{del}");
        assert!(del.contains("CASE m.__planarian_rel WHEN 100 THEN 'public.t' WHEN 101 THEN 'public.c' ELSE ('\"planarian: catalog changed: new relation ' || m.__planarian_rel || '\"')::regclass::text END"), "{del}");
        assert!(del.contains("WHEN 100 THEN m.__planarian_img WHEN 101 THEN (SELECT to_jsonb(o.*) FROM ONLY public.c o WHERE o.\"id\" = m.__planarian_k0) END"), "{del}");
        let up = write("UPDATE t SET x = 'y'").rewrite(std::slice::from_ref(&t), 1, 0, false).unwrap();
        assert!(up.contains("WHEN 101 THEN (SELECT to_jsonb(o.*) FROM ONLY public.c o WHERE o.\"id\" = m.__planarian_k0) END) || m.__planarian_img"), "{up}");
        // ONLY, and a plain INSERT (its rows stay in the parent): the children are not reached.
        for q in [
            "DELETE FROM ONLY t WHERE id = 1",
            "INSERT INTO t VALUES (1, 'a')",
            "INSERT INTO t VALUES (1, 'a') ON CONFLICT (id) DO UPDATE SET x = 'b'",
        ] {
            let sql = write(q).rewrite(std::slice::from_ref(&t), 1, 0, false).unwrap();
            assert!(!sql.contains("tableoid") && !sql.contains("public.c"), "{q}: {sql}");
        }
    }

    #[test]
    fn a_child_without_the_parents_key_or_with_triggers_is_refused_unless_only() {
        let t = with_child(false, &[]);
        let why = write("DELETE FROM t").rewrite(std::slice::from_ref(&t), 1, 0, false).unwrap_err().to_string();
        assert!(why.contains("child table public.c has no primary key (id)") && why.contains("ONLY public.t"), "{why}");
        assert!(write("DELETE FROM ONLY t").rewrite(std::slice::from_ref(&t), 1, 0, false).is_ok());
        let mut t = with_child(true, &["id"]);
        t.descendants[0].problems.push("trigger audit runs on public.c".into());
        let why = write("INSERT INTO t VALUES (1, 'a')")
            .rewrite(std::slice::from_ref(&t), 1, 0, false)
            .unwrap_err()
            .to_string();
        assert!(why.contains("trigger audit runs on public.c (a partition of it)"), "{why}");
    }

    #[test]
    fn rows_routed_to_partitions_record_the_partition() {
        let t = with_child(true, &["id"]);
        let ins = write("INSERT INTO t VALUES (1, 'a')").rewrite(std::slice::from_ref(&t), 1, 0, false).unwrap();
        assert!(ins.contains("CASE m.__planarian_rel WHEN 100 THEN 'public.t' WHEN 101 THEN 'public.c' ELSE ('\"planarian: catalog changed: new relation ' || m.__planarian_rel || '\"')::regclass::text END, NULL::jsonb, m.__planarian_img"), "{ins}");
        // Partitions have exactly the parent's columns: the images come from the statement.
        let up = write("UPDATE t SET x = 'y'").rewrite(std::slice::from_ref(&t), 1, 0, false).unwrap();
        assert!(up.contains("(SELECT to_jsonb(o.*) FROM public.t o WHERE"), "{up}");
    }

    #[test]
    fn unsafe_tables_and_key_changes_are_refused() {
        let mut t = table();
        assert!(write("INSERT INTO t VALUES (1, 'a') ON CONFLICT (id) DO UPDATE SET id = 2")
            .rewrite(std::slice::from_ref(&t), 1, 0, false)
            .unwrap_err()
            .to_string()
            .contains("changes the primary key column id"));
        t.primary_key.clear();
        assert!(write("DELETE FROM t")
            .rewrite(std::slice::from_ref(&t), 1, 0, false)
            .unwrap_err()
            .to_string()
            .contains("no primary key"));
        let mut t = table();
        t.problems.push("trigger audit runs on it".into());
        assert!(write("DELETE FROM t")
            .rewrite(std::slice::from_ref(&t), 1, 0, false)
            .unwrap_err()
            .to_string()
            .contains("trigger audit"));
        assert!(rejected("UPDATE t SET x = u.x FROM u WHERE t.id = u.id RETURNING *").contains("several tables"));
    }

    #[test]
    fn output_names_follow_postgres() {
        let d = write("INSERT INTO t VALUES (1, 'a') RETURNING id AS k, upper(x), x::text, 1::int, CASE WHEN true THEN 1 END, t.x");
        let sql = d.rewrite(std::slice::from_ref(&table()), 1, 0, false).unwrap();
        for n in ["AS \"k\"", "AS \"upper\"", "AS \"x\"", "AS \"int4\"", "AS \"case\""] {
            assert!(sql.contains(n), "{n}: {sql}");
        }
    }
}
